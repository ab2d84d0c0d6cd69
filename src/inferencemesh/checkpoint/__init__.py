"""What a checkpoint holds, learned without loading it, and whether it can be served.

Both the planner (which needs per-layer byte counts) and the stage loader (which needs to know
which shard holds which tensor) start here. Only safetensors headers are read: a checkpoint's
weights are never materialised to describe it.

    facts.py      CheckpointFacts: config, tensor names, dtypes, shapes and bytes per layer
    headers.py    safetensors headers and the shard index, checked as the safetensors library checks them
    validate.py   whether a config and its tensor names can be served (family, quantization, layout)
    read.py       a model argument (a local directory or a hub id) -> its facts or its config files
    hub.py        the model hub: reachability, offline mode, its failures as one CheckpointError
    tokenizer.py  the checkpoint's tokenizer, loaded without its code
    errors.py     CheckpointError and how a name from a file is quoted in it
"""
