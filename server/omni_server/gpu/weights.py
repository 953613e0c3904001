"""Weight sharing between replicas: one copy of an engine's weights per device.

Groups. With `[server] weight_share = "on"`, the replicas of a process (tp_size 1) whose engine
stage (the stage with an `[engine]` table) lands on one device form a sharing group for that
stage: replicas on one GPU id, or, for an engine stage on the CPU, all the process's replicas
(host RAM). The lowest replica of a group is its leader, the others its followers. A replica
alone on its GPU is in no group and loads its own weights.

Protocol (`context.shared_weights(key, load)` in a backend's initialize):
- no group: `load()`;
- leader: `load()`, then every tensor is copied into one region (omni_transport.regions: a
  shared-memory segment on the host, an exported CUDA allocation on a GPU) and the load's own
  tensors are dropped; a manifest (region name, size, and per tensor: offset, bytes, dtype,
  shape) is written atomically, mode 0600, into the private run directory; the leader gets
  tensors viewing the region;
- follower: reads the manifest and trusts none of it: the file must be this user's, mode 0600,
  bounded in size; the region must be this run's and on this device; every block is checked
  against the region (omni_transport.regions.check_block); the leader it names must be alive.
  It returns tensors aliasing the leader's region (host: mapped read-only; GPU: the IPC
  mapping), without calling `load()`.

Order (pipeline/processes.py, `start_waves`, `leaders_of`, `followers_of`): a follower is spawned
only after its leaders are Ready (a bounded wait here is the safety net); a dead leader takes its
followers down with it (they alias memory that is gone) and they come back after it; at stop
followers exit before their leader, which frees the region when it stops (after its backend's
finalize, on the compute thread, so no step runs over freed weights).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_server.compiler.plan import Plan
from omni_server.identity import alive, process_identity

log = logging.getLogger(__name__)

_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MANIFEST_FORMAT = 1
_MANIFEST_MAX_BYTES = 16 << 20  # a manifest of a 10k-tensor model is ~1 MiB
_MAX_TENSORS = 100_000
_WAIT_S = float(os.environ.get("OMNI_WEIGHTS_WAIT_S", "30"))  # a follower's wait for a manifest
_POLL_S = 0.05


class WeightShareError(RuntimeError):
    """The shared weights could not be published or attached; the message says why."""


@dataclass(frozen=True)
class ShareGroup:
    """The replicas of `process` whose engine stage `stage` runs on `device` (None: the host)."""

    process: str
    stage: str
    device: int | None
    members: tuple[int, ...]  # instance indexes, lowest replica (the leader) first

    @property
    def leader(self) -> int:
        return self.members[0]

    @property
    def followers(self) -> tuple[int, ...]:
        return self.members[1:]

    @property
    def name(self) -> str:
        """A name for files and segments: `<process>.<stage>.<cpu|gpuN>`, filesystem-safe."""
        where = "cpu" if self.device is None else f"gpu{self.device}"
        return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.process}.{self.stage}.{where}")


def sharing_groups(plan: Plan) -> list[ShareGroup]:
    """Every weight-sharing group of the plan (none unless weight_share is on)."""
    if not plan.server.weight_share:
        return []
    groups = []
    for proc in plan.processes.values():
        if proc.num_replicas < 2 or proc.tp_size != 1:
            continue
        for stage in proc.stages:
            if plan.stages[stage].engine is None:
                continue
            by_device: dict[int | None, list[tuple[int, int]]] = {}
            for index, inst in enumerate(plan.instances):
                if inst.process == proc.name:
                    by_device.setdefault(inst.devices.get(stage), []).append((inst.replica, index))
            for device, members in by_device.items():
                if len(members) > 1:
                    ordered = tuple(index for _, index in sorted(members))
                    groups.append(ShareGroup(proc.name, stage, device, ordered))
    return groups


def leaders_of(plan: Plan, index: int) -> set[int]:
    """The instances whose weights instance `index` aliases."""
    return {g.leader for g in sharing_groups(plan) if index in g.followers}


def followers_of(plan: Plan, index: int) -> set[int]:
    """The instances that alias weights of instance `index`."""
    return {f for g in sharing_groups(plan) if g.leader == index for f in g.followers}


def start_waves(plan: Plan) -> list[list[int]]:
    """Instance indexes in spawn waves: each wave starts once every earlier one is Ready, and a
    follower comes after all its leaders. Without sharing: one wave of every instance."""
    groups = sharing_groups(plan)
    level: dict[int, int] = {}

    def depth(index: int) -> int:  # leaders have lower replica numbers: this terminates
        if index not in level:
            leaders = {g.leader for g in groups if index in g.followers}
            level[index] = 1 + max(map(depth, leaders)) if leaders else 0
        return level[index]

    waves: dict[int, list[int]] = {}
    for index in range(len(plan.instances)):
        waves.setdefault(depth(index), []).append(index)
    return [waves[d] for d in sorted(waves)]


Load = Callable[[], Mapping[str, Any]]


class WeightSharing:
    """One stage process's side of sharing: what `StageContext.shared_weights` calls.

    Runs on the stage's compute thread (initialize); `close()` after the backends' finalize."""

    def __init__(
        self, plan: Plan, index: int, run_dir: Path, run_id: str, *, wait_s: float = _WAIT_S
    ) -> None:
        """`wait_s`: how long a follower waits for a manifest whose leader is alive."""
        self._index = index
        self._wait_s = wait_s
        self._run_dir = run_dir
        self._run_id = run_id
        self._groups = {g.stage: g for g in sharing_groups(plan) if index in g.members}
        self._regions: list[Any] = []  # what this process owns (leader) or maps (follower)

    @property
    def active(self) -> bool:
        return bool(self._groups)

    def share(self, stage: str, key: str, load: Load) -> dict[str, Any]:
        if not _KEY.match(key):
            raise WeightShareError(f"shared weights key {key!r}: use 1-64 of [A-Za-z0-9_-]")
        group = self._groups.get(stage)
        if group is None:
            return dict(load())
        if group.leader == self._index:
            return self._lead(group, key, load)
        return self._follow(group, key)

    # ---- leader ------------------------------------------------------------------------------

    def _lead(self, group: ShareGroup, key: str, load: Load) -> dict[str, Any]:
        import torch

        from omni_transport import unlink_leftovers
        from omni_transport.regions import CudaRegion, HostRegion, region_bytes

        started = time.perf_counter()
        loaded = dict(load())
        device = torch.device("cpu" if group.device is None else f"cuda:{group.device}")
        unique: dict[tuple[int, str, tuple[int, ...]], str] = {}  # tied weights placed once
        for name, tensor in loaded.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise WeightShareError(f"load() must return {{str: Tensor}}; found {name!r}")
            if tensor.device != device:
                raise WeightShareError(
                    f"weight {name} is on {tensor.device}; the stage's device is {device}"
                )
            unique.setdefault(_identity(tensor), name)
        size = region_bytes(loaded[n] for n in unique.values())
        unlink_leftovers(f"omni-{self._run_id}-w-{group.name}-")  # a dead predecessor's region
        region_name = f"omni-{self._run_id}-w-{group.name}-{key}-{os.getpid()}"
        region: Any = (
            HostRegion(region_name, size)
            if group.device is None
            else CudaRegion(region_name, size, device=group.device)
        )
        self._regions.append(region)
        entries: list[list[Any]] = []
        placed: dict[tuple[int, str, tuple[int, ...]], tuple[int, Any]] = {}
        out: dict[str, Any] = {}
        for name in list(loaded):
            tensor = loaded.pop(name)  # the load's copy goes as soon as it is placed
            ident = _identity(tensor)
            if ident not in placed:
                placed[ident] = region.place(tensor.contiguous())
            offset, view = placed[ident]
            out[name] = view
            nbytes = view.numel() * view.element_size()
            dtype = str(view.dtype).removeprefix("torch.")
            entries.append([name, offset, nbytes, dtype, list(view.shape)])
            del tensor
        if group.device is not None:
            torch.cuda.synchronize(group.device)  # the copies are done before anyone reads
            torch.cuda.empty_cache()  # the load's copies go back to the driver
        self._publish(
            group,
            key,
            {
                "format": _MANIFEST_FORMAT,
                "leader": process_identity(os.getpid()),
                "device": group.device,
                "region": region_name,
                "bytes": region.size,
                "tensors": entries,
            },
        )
        log.info(
            "stage %s: shares %d weights (%.1f MiB) as %s in %.2f s",
            group.stage,
            len(entries),
            region.size / 2**20,
            region_name,
            time.perf_counter() - started,
        )
        return out

    def _publish(self, group: ShareGroup, key: str, manifest: dict[str, Any]) -> None:
        path = self._manifest_path(group, key)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, path)  # readers see the whole manifest or the previous one

    def _manifest_path(self, group: ShareGroup, key: str) -> Path:
        return self._run_dir / f"weights-{group.name}-{key}.json"

    # ---- follower ----------------------------------------------------------------------------

    def _follow(self, group: ShareGroup, key: str) -> dict[str, Any]:
        path = self._manifest_path(group, key)
        deadline = time.monotonic() + self._wait_s
        while True:
            manifest = self._read_manifest(path, group)
            if manifest is not None and alive(manifest["leader"]):
                break
            if time.monotonic() > deadline:
                why = "no manifest" if manifest is None else "its leader is dead"
                raise WeightShareError(
                    f"no shared weights {key!r} from the leader of {group.name} after "
                    f"{self._wait_s:g} s ({why})"
                )
            time.sleep(_POLL_S)  # bounded: the leader was Ready before we were spawned
        return self._attach(group, manifest)

    def _read_manifest(self, path: Path, group: ShareGroup) -> dict[str, Any] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise WeightShareError(f"{path}: not a file of this user with mode 0600: refused")
            data = f.read(_MANIFEST_MAX_BYTES + 1)
        if len(data) > _MANIFEST_MAX_BYTES:
            raise WeightShareError(f"{path}: over {_MANIFEST_MAX_BYTES} bytes: refused")
        try:
            manifest = json.loads(data)
        except ValueError as exc:
            raise WeightShareError(f"{path}: not JSON ({exc})") from None
        return _checked_manifest(manifest, path, group, self._run_id)

    def _attach(self, group: ShareGroup, manifest: dict[str, Any]) -> dict[str, Any]:
        from omni_transport import TransportError
        from omni_transport.regions import CudaRegionView, HostRegionView

        try:
            view: Any = (
                HostRegionView(manifest["region"], manifest["bytes"])
                if group.device is None
                else CudaRegionView(manifest["region"], device=group.device)
            )
        except (OSError, TransportError) as exc:
            raise WeightShareError(f"region {manifest['region']}: {exc}") from exc
        self._regions.append(view)
        if view.size < manifest["bytes"]:
            raise WeightShareError(f"region {view.name}: {view.size} bytes, manifest says more")
        out = {}
        try:
            for name, offset, nbytes, dtype, shape in manifest["tensors"]:
                out[name] = view.tensor(offset, nbytes, dtype, tuple(shape))
        except TransportError as exc:
            raise WeightShareError(f"region {view.name}: {exc}") from exc
        log.info("stage %s: aliases %d weights of %s", group.stage, len(out), view.name)
        return out

    # ---- the end -----------------------------------------------------------------------------

    def contains(self, address: int) -> bool:
        """Whether `address` lies in a region this process owns or maps (tests, diagnostics)."""
        return any(r.contains(address) for r in self._regions if hasattr(r, "contains"))

    def close(self) -> None:
        """Followers unmap; a leader frees its region (its followers stopped first)."""
        for region in reversed(self._regions):
            region.close()
        self._regions.clear()


def _identity(tensor: Any) -> tuple[int, str, tuple[int, ...]]:
    """Same memory, dtype and shape: one tensor under two names (tied embeddings)."""
    return (tensor.data_ptr(), str(tensor.dtype), tuple(tensor.shape))


def _checked_manifest(manifest: Any, path: Path, group: ShareGroup, run_id: str) -> dict[str, Any]:
    def bad(why: str) -> WeightShareError:
        return WeightShareError(f"{path}: {why}: refused")

    if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
        raise bad("not a weights manifest of this version")
    region, size = manifest.get("region"), manifest.get("bytes")
    if not isinstance(region, str) or not region.startswith(f"omni-{run_id}-w-{group.name}-"):
        raise bad(f"region {region!r} is not this run's region of {group.name}")
    if manifest.get("device") != group.device:
        raise bad(f"device {manifest.get('device')!r}, this replica's is {group.device!r}")
    if type(size) is not int or not 0 < size <= 1 << 42:
        raise bad(f"region size {size!r}")
    if not isinstance(manifest.get("leader"), str):
        raise bad("no leader identity")
    tensors = manifest.get("tensors")
    if not isinstance(tensors, list) or len(tensors) > _MAX_TENSORS:
        raise bad("tensors is not a list of at most 100000 entries")
    names = set()
    for entry in tensors:
        if not (
            isinstance(entry, list)
            and len(entry) == 5
            and isinstance(entry[0], str)
            and type(entry[1]) is int
            and type(entry[2]) is int
            and isinstance(entry[3], str)
            and isinstance(entry[4], list)
            and len(entry[4]) <= 64
            and all(type(d) is int for d in entry[4])
        ):
            raise bad(f"tensor entry {str(entry)[:200]}")
        if entry[0] in names:
            raise bad(f"tensor {entry[0]!r} twice")
        names.add(entry[0])
    return manifest
