"""Issue #5's GPU runs of the doctor (the cap finding, the report, the diagnostics' cost) as one
script: `run` (the steps and the record; `python -m benchmarks.engine.doctor_acceptance`),
`plan` (its pure helpers), `state` (the run's record and files), `host` (the environment and
the server subprocess)."""
