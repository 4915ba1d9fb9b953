"""Training loops: a function of one context, run on every rank (`fn(ctx)`).

`context` is what a loop gets (`LoopContext`: rank, loader, prepare, save/restore, log,
register); `builtin` is shardline's own loop written on that context (the model-factory
path: setup, epoch, evaluate, checkpoint); `runner` is the one rank function every
launcher calls (it builds the context and runs the job's loop, the user's or the
built-in); `function` is how a user's loop travels to the ranks (by import path, or by
value for a notebook's function) and is checked on the driver; `state` writes and reads
a loop's nested state with torch.distributed.checkpoint through the job's checkpoint
store; `register` turns a loop's model into the registered model.
"""
