"""The consumer process of test_cuda_ipc.py: opens tensors from the producer's pool, reports
what it sees, and releases them only when told. Messages come over one ring, replies go back
over another, both as JSON headers."""

from __future__ import annotations

import json
import sys

from omni_transport import Ring, tensor_records
from omni_transport.cuda_ipc import BadTensorRecord, CudaReceiver, TensorRecord


def main() -> int:
    inbox = Ring.attach(sys.argv[1], role="consumer")
    outbox = Ring.attach(sys.argv[2], role="producer")
    rx = CudaReceiver()
    held: list[TensorRecord] = []
    views: list = []  # tensors of packed records: their blocks go back when these are freed
    try:
        while True:
            with inbox.pop(timeout=120) as rec:
                msg = bytes(rec.header)
            if msg == b"stop":
                return 0
            if msg in (b"release", b"release-later"):
                wait = msg == b"release"
                for trec in held:
                    rx.release(trec, wait=wait)
                reply = {"released": len(held), "releasing": rx.releasing}
                while rx.reap():  # released without waiting: hand back once the work is done
                    pass
                outbox.push(json.dumps(reply).encode())
                held.clear()
                continue
            if msg == b"drop-views":
                reply = {"dropped": len(views)}
                views.clear()  # the deleters queue the blocks' release on the stream
                outbox.push(json.dumps(reply).encode())
                continue
            if msg.startswith(b"OTR1"):  # a one-tensor record (export_packed)
                try:
                    key, tensor = rx.open_packed(msg)
                except BadTensorRecord as exc:
                    outbox.push(json.dumps({"error": str(exc)}).encode())
                    continue
                pool, _ = tensor_records.decode(msg, tensor_records.new())
                views.append(tensor)
                packed_reply = json.dumps(
                    {
                        "key": key,
                        "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape),
                        "sum": float(tensor.double().sum()),
                        # zero-copy: the tensor is the block, in the opened pool
                        "offset_seen": tensor.data_ptr() - rx.mapped_at(pool),
                    }
                ).encode()
                del tensor  # `views` alone holds it: drop-views frees it
                outbox.push(packed_reply)
                continue
            trec = TensorRecord.from_bytes(msg)
            tensor = rx.open(trec)
            reply = {
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "sum": float(tensor.double().sum()),
                "first": tensor.flatten()[:4].double().tolist(),
                # zero-copy: the tensor lies in the opened pool at the record's offset
                "offset_seen": tensor.data_ptr() - rx.mapped_at(trec.pool),
            }
            del tensor
            held.append(trec)
            outbox.push(json.dumps(reply).encode())
    finally:
        rx.close()
        inbox.close()
        outbox.close()


if __name__ == "__main__":
    sys.exit(main())
