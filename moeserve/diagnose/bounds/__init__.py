"""What a step could cost at best, from the model's shape and the device's measured ceilings:
roofline.py (a step's bytes and FLOPs, the H200's ceilings, a run's serial roofline and the
share of it reached), step_parts.py (the step profile's parts each against its own bound),
kv_bound.py (the throughput a fixed-length run's KV cache allows: a replay of its requests
through an ideal engine)."""
