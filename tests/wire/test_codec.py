"""The message codec: arrays out of band, tensors of every dtype, nested payloads."""

from __future__ import annotations

import numpy as np
import torch

from omni_server.wire.codec import decode, encode
from omni_server.wire.messages import Deliver, Envelope


def roundtrip(message):
    header, buffers = encode(message)
    # as a ring delivers them: copies of the buffer bytes
    return decode(header, [bytearray(b) for b in buffers]), header, buffers


def test_arrays_travel_out_of_band_and_come_back_equal():
    audio = np.linspace(-1, 1, 100_000, dtype=np.float32)
    message = Deliver(Envelope(7, "req", {"vocoder": 1}), "b", "a", {"audio": audio, "n": 3})
    back, header, buffers = roundtrip(message)
    assert len(header) < 1000 and [len(b) for b in buffers] == [audio.nbytes]
    assert back.env == message.env and back.stage == "b" and back.source == "a"
    assert np.array_equal(back.payload["audio"], audio) and back.payload["n"] == 3


def test_tensors_keep_dtype_shape_and_values_including_bfloat16():
    payload = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5, dtype=torch.bfloat16),
        "i64": torch.arange(6).reshape(2, 3),
        "nested": [{"t": torch.ones(2, dtype=torch.float16)}, (b"raw", None, 1.5)],
        "strided": torch.arange(12).reshape(3, 4).T,  # not contiguous
    }
    back, _, buffers = roundtrip(payload)
    assert len(buffers) == 5
    for key in ("f32", "bf16", "i64", "strided"):
        assert back[key].dtype == payload[key].dtype
        assert torch.equal(back[key], payload[key])
    assert torch.equal(back["nested"][0]["t"], payload["nested"][0]["t"])
    assert back["nested"][1] == (b"raw", None, 1.5)
