"""The 24 -> 16 kHz step in front of the semantic model, as the reference tokenizer resamples:
band-limited sinc interpolation with a Hann window (6 zero crossings, cut-off at 0.99 of the
lower Nyquist), the algorithm `torchaudio.functional.resample` documents and runs by default.

Written here so the tokenizer needs no torchaudio (which has no build for our torch), and the
same arithmetic as that function's in the same order (the filter evaluated in the signal's
dtype), so a clip reaches HuBERT as it does in the reference and encodes to the same codes.

Polyphase form: with both rates divided by their gcd (24000 / 16000 -> 3 / 2), output sample
j + 2 m is one filter j applied at input sample 3 m: one strided conv1d with 2 output channels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ZERO_CROSSINGS = 6  # the filter's half-width, in zero crossings of the sinc
ROLLOFF = 0.99  # cut-off, as a fraction of the lower rate's Nyquist frequency


def sinc_filters(
    in_rate: int, out_rate: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, int]:
    """One filter per output phase [out_rate / g, 1, taps] and the input's padding on the left
    (taps = 2 * pad + in_rate / g), for rates reduced by their gcd g."""
    g = math.gcd(in_rate, out_rate)
    step_in, step_out = in_rate // g, out_rate // g
    cutoff = min(step_in, step_out) * ROLLOFF
    pad = math.ceil(ZERO_CROSSINGS * step_in / cutoff)
    # time of each input tap relative to each output phase, in units of 1 / cutoff
    taps = torch.arange(-pad, pad + step_in, dtype=dtype, device=device)[None, None] / step_in
    phases = torch.arange(0, -step_out, -1, dtype=dtype, device=device)[:, None, None] / step_out
    t = (phases + taps) * cutoff
    t = t.clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    return sinc * (window * (cutoff / step_in)), pad


def resample(audio: torch.Tensor, in_rate: int, out_rate: int) -> torch.Tensor:
    """[..., S] at in_rate -> [..., ceil(S * out_rate / in_rate)] at out_rate (same dtype)."""
    if in_rate == out_rate:
        return audio
    filters, pad = sinc_filters(in_rate, out_rate, audio.dtype, audio.device)
    g = math.gcd(in_rate, out_rate)
    step_in, step_out = in_rate // g, out_rate // g
    shape = audio.shape
    rows = audio.reshape(-1, shape[-1])
    length = rows.shape[-1]
    out = F.conv1d(F.pad(rows, (pad, pad + step_in))[:, None], filters, stride=step_in)
    out = out.transpose(1, 2).reshape(rows.shape[0], -1)  # phases interleaved
    keep = math.ceil(step_out * length / step_in)
    return out[:, :keep].reshape(*shape[:-1], -1)
