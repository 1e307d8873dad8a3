"""What shards a model: this rank's place inside its replica and the collectives the
sharded layers call (`context.py`). `models/`, `weights/` and `worker/` import it; it
imports nothing of the project above `config`. What starts and connects the processes
is `cluster/`.
"""
