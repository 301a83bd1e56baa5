"""Data: the three formats, assistant-only masking, bad rows with file:line, packing layout, schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardfit.data.dataset import DataStats, load_conversations
from shardfit.data.formats import ALPACA, OPENAI, SHAREGPT, detect_format, to_messages
from shardfit.data.loader import BatchSchedule, collate
from shardfit.data.packing import PACK_MIN_PADDING, PackedRow, no_pack, pack, pack_where_padded
from shardfit.data.tokenize import IGNORE, Encoded, encode_messages
from shardfit.errors import UserError
from shardfit.resolve.job import RowShape

ALPACA_ROW = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
SHAREGPT_ROW = {"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Bye"},
                                  {"from": "gpt", "value": "Goodbye."}]}
OPENAI_ROW = {"messages": [{"role": "user", "content": "Capital of France?"},
                           {"role": "assistant", "content": "Paris."}]}


def test_detect_and_convert_each_format() -> None:
    assert detect_format(ALPACA_ROW) == ALPACA
    assert detect_format(SHAREGPT_ROW) == SHAREGPT
    assert detect_format(OPENAI_ROW) == OPENAI
    assert to_messages(ALPACA_ROW, ALPACA) == [{"role": "user", "content": "Add the numbers.\n\n2 and 3"},
                                               {"role": "assistant", "content": "5"}]
    msgs = to_messages(SHAREGPT_ROW, SHAREGPT)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert to_messages(OPENAI_ROW, OPENAI)[1] == {"role": "assistant", "content": "Paris."}


@pytest.mark.parametrize("row", [ALPACA_ROW, SHAREGPT_ROW, OPENAI_ROW])
def test_only_assistant_tokens_are_trained(tokenizer, row: dict) -> None:
    fmt = detect_format(row)
    messages = to_messages(row, fmt)
    enc = encode_messages(tokenizer, messages, max_len=512)
    trained = [enc.input_ids[i + 1] for i, t in enumerate(enc.targets) if t != IGNORE]
    assert trained == [t for t in enc.targets if t != IGNORE]  # targets are the next tokens
    text = tokenizer.decode(trained)
    expected = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
    assert text == expected
    # Nothing of the prompt is trained.
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] not in text


def test_truncation(tokenizer) -> None:
    enc = encode_messages(tokenizer, to_messages(SHAREGPT_ROW, SHAREGPT), max_len=20)
    assert len(enc.input_ids) == 20 and enc.targets[-1] == IGNORE


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_bad_row_names_file_and_line(tmp_path: Path) -> None:
    f = _write(tmp_path / "d.jsonl", [ALPACA_ROW, ALPACA_ROW, {"instruction": "x"}, ALPACA_ROW])
    with pytest.raises(UserError, match=r"d.jsonl:3: alpaca row without 'output'.*skip_bad_rows"):
        load_conversations(str(f), False, DataStats())
    f = _write(tmp_path / "e.jsonl", [OPENAI_ROW, '{"messages": [oops'])
    with pytest.raises(UserError, match=r"e.jsonl:2: not valid JSON"):
        load_conversations(str(f), False, DataStats())
    f = _write(tmp_path / "g.jsonl", [{"text": "no format"}])
    with pytest.raises(UserError, match=r"g.jsonl:1: unknown format"):
        load_conversations(str(f), False, DataStats())


def test_skip_bad_rows_counts(tmp_path: Path) -> None:
    f = _write(tmp_path / "d.jsonl", [ALPACA_ROW, "{broken", {"instruction": "x"}, ALPACA_ROW])
    stats = DataStats()
    conv = load_conversations(str(f), True, stats)
    assert len(conv) == 2 and stats.skipped == 2
    assert stats.skipped_where == [f"{f}:2", f"{f}:3"]


def test_json_array_file(tmp_path: Path) -> None:
    f = tmp_path / "d.json"
    f.write_text(json.dumps([SHAREGPT_ROW, SHAREGPT_ROW]))
    assert len(load_conversations(str(f), False, DataStats())) == 2
    f.write_text(json.dumps([SHAREGPT_ROW, {"conversations": [{"from": "alien", "value": "x"}]}]))
    with pytest.raises(UserError, match=r"d.json: item 1: conversations\[0\]: unknown speaker 'alien'"):
        load_conversations(str(f), False, DataStats())


def test_packing_layout(tokenizer) -> None:
    examples = [encode_messages(tokenizer, to_messages(r, detect_format(r)), 512)
                for r in (ALPACA_ROW, SHAREGPT_ROW, OPENAI_ROW, ALPACA_ROW)]
    rows = pack(examples, max_len=128)
    assert sum(len(r) for r in rows) == sum(len(e.input_ids) for e in examples)
    assert all(len(r) <= 128 for r in rows) and len(rows) < len(examples)
    for r in rows:  # positions restart at 0 at each example boundary
        starts = [i for i, p in enumerate(r.position_ids) if p == 0]
        assert starts[0] == 0 and len(starts) >= 1
    assert len(no_pack(examples)) == 4


def test_packing_only_where_padding_would_be_a_real_share() -> None:
    """Near-equal lengths keep one example per row (a packed row's masked attention costs more than the padding
    saved); a long example among short ones packs the short ones together."""
    even = [Encoded(list(range(n)), [1] * n) for n in (60, 64, 58, 62)]  # padding to 64: 6 % of the tokens
    assert [r.input_ids for r in pack_where_padded(even, 256)] == [r.input_ids for r in no_pack(even)]
    tail = [Encoded(list(range(n)), [1] * n) for n in (120, 10, 12, 9)]  # padding to 120: 68 %
    assert 1 - sum(map(len, (e.input_ids for e in tail))) / (4 * 120) >= PACK_MIN_PADDING
    packed = pack_where_padded(tail, 256)
    assert len(packed) < 4 and [r.input_ids for r in packed] == [r.input_ids for r in pack(tail, 256)]


def test_collate_pads_after_the_last_example() -> None:
    """Padding continues its row's positions (no restart, so an unpacked batch needs no block mask) and carries no
    target; a packed row keeps its own restarts."""
    rows = [PackedRow([5, 6, 7], [6, 7, IGNORE], [0, 1, 2]), PackedRow([8], [IGNORE], [0]),
            PackedRow([3, 4], [4, IGNORE], [0, 0])]
    b = collate(rows, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 0, 0], [3, 4, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2], [0, 1, 2], [0, 0, 1]]
    assert b.targets[1].tolist() == [IGNORE] * 3 and b.n_real_tokens == 6


def test_schedule_same_global_batch_at_any_world_size() -> None:
    rows = [Encoded([i], [i]) for i in range(10)]
    single = BatchSchedule(rows, micro_batch=2, grad_accum=2, world=1, rank=0, seed=3)
    r0 = BatchSchedule(rows, micro_batch=2, grad_accum=1, world=2, rank=0, seed=3)
    r1 = BatchSchedule(rows, micro_batch=2, grad_accum=1, world=2, rank=1, seed=3)
    assert single.steps_per_epoch == r0.steps_per_epoch == 3  # 10 examples, 4 per step, last step wraps
    for step in range(4):
        a = [r.input_ids[0] for mb in single.step(step).micro_batches for r in mb]
        b = [r.input_ids[0] for mb in r0.step(step).micro_batches + r1.step(step).micro_batches for r in mb]
        assert sorted(a) == sorted(b)
        assert single.step(step).global_targets == r0.step(step).global_targets
    epoch0 = [r.input_ids[0] for s in range(3) for mb in single.step(s).micro_batches for r in mb]
    assert set(epoch0) == set(range(10))  # no example dropped


def _lengths_mix(n: int) -> list[Encoded]:
    """A long-tailed length mix: mostly short examples, every seventh a long one."""
    return [Encoded(list(range(40 if i % 7 == 0 else 3 + i % 5)), [1] * (40 if i % 7 == 0 else 3 + i % 5))
            for i in range(n)]


@pytest.mark.parametrize(("n", "mb", "accum", "world"), [(23, 4, 1, 1), (23, 2, 3, 1), (23, 2, 2, 2), (8, 4, 2, 2)])
def test_packing_keeps_the_examples_per_step_of_an_unpacked_run(n: int, mb: int, accum: int, world: int) -> None:
    """micro_batch counts examples with packing on as off: ceil(N / (mb x accum x world)) steps per epoch, every
    step the same examples (so the same targets and tokens) and every rank `accum` forwards; packing only puts a
    micro-batch's examples in fewer rows."""
    examples = _lengths_mix(n)
    packed = [BatchSchedule(examples, mb, accum, world, r, seed=1, form=lambda ex: pack(ex, 64)) for r in range(world)]
    plain = [BatchSchedule(examples, mb, accum, world, r, seed=1) for r in range(world)]
    want = -(-n // (mb * accum * world))
    assert {s.steps_per_epoch for s in packed + plain} == {want}
    fewer_rows = False
    for step in range(want + 1):  # into the second epoch
        p = [s.step(step) for s in packed]
        u = [s.step(step) for s in plain]
        assert p[0].global_examples == u[0].global_examples == mb * accum * world
        assert p[0].global_targets == u[0].global_targets and p[0].global_tokens == u[0].global_tokens
        for a, b in zip(p, u, strict=True):
            assert len(a.micro_batches) == len(b.micro_batches) == accum
            for pm, um in zip(a.micro_batches, b.micro_batches, strict=True):
                assert sorted(t for r in pm for t in r.input_ids) == sorted(t for r in um for t in r.input_ids)
                assert all(len(r) <= 64 for r in pm) and len(um) == mb
                fewer_rows |= len(pm) < len(um)
    assert fewer_rows


def test_collate_rounds_widths_to_a_multiple_within_the_limit() -> None:
    rows = [PackedRow(list(range(5)), [IGNORE] * 5, list(range(5)))]
    assert collate(rows, 0, RowShape(limit=64, micro_batch=1, multiple=4)).input_ids.shape == (1, 8)
    # Never past max_seq_len, nor below the longest row.
    assert collate(rows, 0, RowShape(limit=6, micro_batch=1, multiple=4)).input_ids.shape == (1, 6)
    assert collate(rows, 0, RowShape(limit=3, micro_batch=1, multiple=4)).input_ids.shape == (1, 5)
    b = collate(rows, 0, RowShape(limit=64, micro_batch=1, multiple=4))
    assert b.position_ids.tolist() == [list(range(8))] and b.n_real_tokens == 5


def test_collate_coarsens_the_width_step_for_wide_rows() -> None:
    def width(n: int) -> int:
        row = PackedRow(list(range(n)), [IGNORE] * n, list(range(n)))
        return collate([row], 0, RowShape(limit=4096, micro_batch=1, multiple=16)).input_ids.shape[1]

    # An eighth of the row's power of two, never below `multiple`: at most 1/8 padding, few distinct shapes.
    assert [width(n) for n in (5, 97, 130, 300, 513, 1000)] == [16, 112, 144, 320, 576, 1024]
    assert len({width(n) for n in range(1, 1025)}) == 32  # steps of 16 everywhere: 64


def test_collate_pads_rows_up_to_a_fixed_height() -> None:
    b = collate([PackedRow([5, 6], [6, IGNORE], [0, 1])], 0, RowShape(limit=4, micro_batch=3, width=4, height=3))
    assert b.input_ids.shape == (3, 4) and b.n_real_tokens == 2
    assert b.position_ids[2].tolist() == [0, 1, 2, 3] and (b.targets[1:] == IGNORE).all()
