"""`moeserve tune`: the seeds' loop of hand tuning as one command.

    space.py      the knobs: config field, values, device, restart (declared once)
    evaluate.py   one config measured: a real server and a real bench; the failure kinds
    steer.py      the doctor's verdicts on the best trial -> the next trials
    study.py      the Optuna study (the ledger), the search loop, resume, the budget
    confirm.py    best vs start, alternating on fresh servers: gain or noise
    ablation.py   one knob at a time back to the start; Optuna's importances
    report.py     tune.md, tune.json, plots; the winner's command line
    cli.py        flags, phases, progress, Ctrl-C
"""
