"""The stage room: what runs inside a stage process (`python -m omni_server.stage.worker`): the
worker's main, the stage host and its stage nodes, stream inboxes, timeouts, the compute
thread, backends, memory budgets, tensor parallelism and the schedulers. It never imports the
pipeline room (the server process's side)."""
