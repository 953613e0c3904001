"""Higgs Audio v2's frame draw (`frames.draw_frames`) on hand-made logits: each codebook's codes
follow its softmax, the delay pattern's forced codes, repetition-aware redraws from the raw
softmax, and every row's frame independent of the rows beside it. The engine-level checks
(greedy frames equal transformers', seeded frames batch-independent) are test_higgs_audio.py's."""

from __future__ import annotations

import torch

from omni_server.engine.families.higgs_audio_v2.frames import AudioSpec, draw_frames, frame_table
from omni_server.engine.sampling import SamplingParams, sampling_row
from omni_server.models.draws import request_seed

# two codebooks of 6 codes, BOS 4 and EOS 5 (the token ids are not read by the draw)
SPEC = AudioSpec(
    num_codebooks=2, codebook_size=6, stream_bos_id=4, stream_eos_id=5, audio_token_id=100,
    audio_bos_token_id=101, audio_delay_token_id=102, eos_token_id=103,
)  # fmt: skip
CODEBOOKS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0], [0.0, 1.5, -0.5, 1.0, -3.0, -3.0]])
LOGITS = CODEBOOKS.view(1, 12)  # [1, K * C]
FREE = (-1, -1, 9, 9)  # delay starts: no BOS forced past frame 0, no EOS before 9 delay tokens
CHI2_999_DF5 = 20.52


def _rows(params: SamplingParams, n: int, drawn: int = 5, starts: tuple = FREE, ras: int = 0):
    """frame_table rows of one request at n positions (frames drawn so far `drawn`, no delay
    token yet)."""
    row = sampling_row(params, request_seed(params.seed))
    return [(*row, 200 + p, drawn, 0, ras, *starts) for p in range(n)]


def _chi_square(codes: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(codes, minlength=len(probs)).double()
    e = probs.double() * len(codes)
    return float(((counts - e) ** 2 / e).sum())


def test_each_codebook_follows_its_softmax() -> None:
    n = 20000
    table = frame_table(_rows(SamplingParams(temperature=1.0, seed=4), n), SPEC)
    frames = draw_frames(LOGITS.expand(n, -1), SPEC, table, None, sampled=True)  # [n, 2]
    for k in range(2):
        assert _chi_square(frames[:, k], CODEBOOKS[k].softmax(-1)) < CHI2_999_DF5, k
    # the two codebooks draw different lanes: their codes are not tied together
    both = (frames[:, 0] == 0) & (frames[:, 1] == 1)
    p0, p1 = CODEBOOKS[0].softmax(-1)[0], CODEBOOKS[1].softmax(-1)[1]
    assert abs(both.double().mean() - p0 * p1) < 0.02


def test_the_delay_pattern_forces_bos_then_eos() -> None:
    params = SamplingParams(temperature=1.0, seed=4)
    # codebook 0 forced to BOS at frames 0..0, codebook 1 at frames 0..1 (starts 0 and 1)
    starts = (0, 1, 9, 9)
    at = [frame_table(_rows(params, 50, drawn=t, starts=starts), SPEC) for t in range(3)]
    frames = [draw_frames(LOGITS.expand(50, -1), SPEC, table, None, True) for table in at]
    assert (frames[0] == 4).all()  # frame 0: both BOS
    assert (frames[1][:, 1] == 4).all() and (frames[1][:, 0] != 4).any()  # frame 1: only k=1
    assert (frames[2] != 4).any(dim=0).all()  # frame 2: none forced
    # EOS: codebook 0 once one delay token was the last token, codebook 1 after two
    eos_starts = (-1, -1, 1, 2)
    rows = _rows(params, 50, starts=eos_starts)
    one = frame_table([(*r[:8], 1, *r[9:]) for r in rows], SPEC)  # DELAYS column = 1
    frame = draw_frames(LOGITS.expand(50, -1), SPEC, one, None, True)
    assert (frame[:, 0] == 5).all() and (frame[:, 1] != 5).any()


def test_repetition_aware_redraw_takes_the_raw_softmax_and_spares_the_rest() -> None:
    n = 20000
    greedy = SamplingParams(temperature=0, seed=8)  # greedy frames: (0, 1) every time
    table = frame_table(_rows(greedy, n, ras=2), SPEC)
    window = torch.full((n, 7, 2), -1, dtype=torch.int64)
    window[:, -2:, 0] = 0  # codebook 0's code 0 twice in the window: a repeat
    window[:, -1:, 1] = 1  # codebook 1's code 1 once: not yet
    frames = draw_frames(LOGITS.expand(n, -1), SPEC, table, window, sampled=False)
    assert (frames[:, 1] == 1).all()
    assert _chi_square(frames[:, 0], CODEBOOKS[0].softmax(-1)) < CHI2_999_DF5
    off = frame_table(_rows(greedy, n, ras=0), SPEC)  # ras_max_repeat 0: no redraw
    assert (draw_frames(LOGITS.expand(n, -1), SPEC, off, window, False)[:, 0] == 0).all()


def test_a_rows_frame_does_not_depend_on_its_neighbours() -> None:
    mine = _rows(SamplingParams(temperature=0.8, top_k=4, seed=21), 30)
    alone = torch.stack(
        [draw_frames(LOGITS, SPEC, frame_table([r], SPEC), None, True)[0] for r in mine]
    )
    others = _rows(SamplingParams(temperature=0), 30, drawn=0, starts=(0, 1, 9, 9))
    logits = torch.cat([LOGITS.flip(-1), LOGITS]).repeat(30, 1)  # [60, 12]
    rows = [row for pair in zip(others, mine, strict=True) for row in pair]
    batched = draw_frames(logits, SPEC, frame_table(rows, SPEC), None, True)[1::2]
    assert torch.equal(batched, alone)
