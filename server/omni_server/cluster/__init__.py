"""The cluster room: a repository served on a Ray cluster through Ray Serve (docs/scaling.md).

One Serve replica runs one whole pipeline (`deployment.PipelineReplica`: the single-host
server's runtime and aiohttp app, on a private socket); Serve's HTTP proxy routes requests to
replicas and `forward.Forwarder` hands each to its replica's server unchanged. `resources`
reads what Ray must reserve from the plan; `command` is `omni-server ray`. Needs the `ray`
extra (`pip install 'omni-server[ray]'`); nothing outside this room imports Ray, and only the
command line imports this room, on demand.
"""
