"""The receiving process of test_cuda_packed.py: a wire endpoint "b" that answers each message
from "a" with what it received (a packed one-tensor record arrives as the tensor itself)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import torch

from omni_server.wire import Endpoint, cuda_lane


async def main(run_dir: str) -> None:
    torch.cuda.set_device(0)
    endpoint = Endpoint(Path(run_dir), "pk", "b", 8 << 20, {"a": frozenset({0})})
    endpoint.create_inbound(["a"])
    done = asyncio.Event()

    def handle(message: Any) -> None:
        if isinstance(message, dict) and message.get("stop"):
            done.set()
            return
        keyed = isinstance(message, dict)
        t = message["t"] if keyed else message
        endpoint.send_data(
            "a",
            {
                "keyed": keyed,
                "keys": sorted(message) if keyed else [],
                "device": str(t.device),
                "dtype": str(t.dtype),
                "shape": list(t.shape),
                "sum": float(t.detach().double().sum()),
                "requires_grad": t.requires_grad,
                "packed": cuda_lane.stats["packed_received"],
            },
        )

    endpoint.start_receiving(handle, lambda _: done.set())
    endpoint.send_data("a", {"ready": True})
    await done.wait()
    await endpoint.flush()
    await endpoint.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
