"""Token files, the synthetic source, global batches that do not depend on the plan, `flashflex data prepare`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from flashflex_cli.data.prepare import prepare_files
from flashflex_cli.data.token_file import HEADER_BYTES, TokenFile, write_token_file
from flashflex_cli.errors import InputError
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.runtime.training.data import (
    SyntheticSource,
    TokenFileSource,
    open_source,
    pipeline_rows,
    stage_tokens,
)
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
TEXT = "It was a bright cold day in April, and the clocks were striking thirteen.\n" * 40


def test_token_file_round_trip_and_header(tmp_path: Path) -> None:
    ids = np.arange(1000) % 300
    path = write_token_file(tmp_path / "t.bin", ids, vocab_size=300)
    assert path.stat().st_size == HEADER_BYTES + 2 * 1000  # uint16 tokens
    tf = TokenFile(path)
    assert tf.vocab_size == 300 and len(tf) == 1000
    assert np.array_equal(np.asarray(tf.tokens), ids)
    big = write_token_file(tmp_path / "big.bin", np.array([0, 70000]), vocab_size=70001)
    assert big.stat().st_size == HEADER_BYTES + 4 * 2  # uint32 beyond 65536 ids
    assert list(TokenFile(big).tokens) == [0, 70000]


def test_bad_token_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "text.bin").write_text("not tokens" * 10)
    with pytest.raises(InputError, match="bad magic"):
        TokenFile(tmp_path / "text.bin")
    path = write_token_file(tmp_path / "t.bin", np.arange(100), vocab_size=256)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(InputError, match="truncated"):
        TokenFile(path)
    with pytest.raises(InputError, match="ids must lie"):
        write_token_file(tmp_path / "x.bin", np.array([5, 300]), vocab_size=256)
    short = write_token_file(tmp_path / "short.bin", np.arange(10), vocab_size=256)
    with pytest.raises(InputError, match="fewer than one sequence"):
        TokenFileSource(short, global_batch=2, seq_len=16)
    vocab = write_token_file(tmp_path / "v.bin", np.arange(1000) % 500, vocab_size=500)
    with pytest.raises(InputError, match="exceeds the model's vocab_size 256"):
        open_source(str(vocab), 256, 4, 16)


def test_token_batches_are_windows_of_the_file_and_deterministic(tmp_path: Path) -> None:
    ids = np.arange(4097) % 256
    path = write_token_file(tmp_path / "t.bin", ids, vocab_size=256)
    source = TokenFileSource(path, global_batch=8, seq_len=16, seed=3)
    batch = source.global_batch(5)
    assert batch.dtype == torch.int64 and tuple(batch.shape) == (8, 17)
    for row in batch:  # every row is a contiguous window of the file
        assert torch.equal(torch.diff(row) % 256, torch.ones(16, dtype=torch.int64))
    again = TokenFileSource(path, global_batch=8, seq_len=16, seed=3)
    assert torch.equal(again.global_batch(5), batch)
    assert not torch.equal(TokenFileSource(path, 8, 16, seed=4).global_batch(5), batch)
    # one epoch visits every window exactly once: 4096 / 16 = 256 windows = 32 steps of 8
    firsts = torch.cat([source.global_batch(k)[:, 0] for k in range(32)])
    assert sorted(firsts.tolist()) == sorted(((np.arange(256) * 16) % 256).tolist())


def test_synthetic_is_deterministic_and_learnable() -> None:
    a = SyntheticSource(256, global_batch=4, seq_len=32, seed=0)
    batch = a.global_batch(7)
    assert tuple(batch.shape) == (4, 33) and batch.dtype == torch.int64
    assert torch.equal(batch, SyntheticSource(256, 4, 32, seed=0).global_batch(7))
    assert not torch.equal(batch, a.global_batch(8))
    stride = (batch[:, 1:] - batch[:, :-1]) % 256  # each row is an arithmetic sequence mod vocab
    assert torch.all(stride == stride[:, :1]) and int(batch.max()) < 256


def test_pipelines_share_the_same_global_batch_under_any_plan() -> None:
    source = SyntheticSource(256, global_batch=8, seq_len=32, seed=0)
    batch = source.global_batch(2)
    for name in ("plan-1rank.json", "plan-3rank.json", "plan-4rank.json"):
        plan = load_plan(GOLDEN / name)
        sequences = [p.sequences for p in plan.pipelines]
        parts = [batch[pipeline_rows(sequences, p)] for p in range(len(plan.pipelines))]
        assert torch.equal(torch.cat(parts), batch)
    assert pipeline_rows([4, 4], 1) == slice(4, 8)


def test_rows_equal_the_global_batch_slice_and_read_only_those_rows(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A first or last stage builds only its pipeline's rows: the same values as global_batch(step)[rows], with
    one file read per row taken (a middle stage calls nothing)."""
    path = write_token_file(tmp_path / "t.bin", np.arange(4097) % 256, vocab_size=256)
    sources = [TokenFileSource(path, global_batch=8, seq_len=16, seed=3), SyntheticSource(256, 8, 16, seed=1)]
    for source in sources:
        for step in (0, 5, 40):  # step 40 lies in the second epoch of the token file (32 steps an epoch)
            batch = source.global_batch(step)
            for rows in (slice(0, 8), slice(0, 3), slice(3, 8), slice(5, 6)):
                got = source.rows(step, rows)
                assert got.dtype == torch.int64 and torch.equal(got, batch[rows])
    reads: list[int] = []
    real_read = TokenFile.read
    monkeypatch.setattr(TokenFile, "read", lambda self, start, count: reads.append(start) or real_read(self, start, count))
    sources[0].rows(7, slice(2, 5))
    assert len(reads) == 3
    assert torch.equal(stage_tokens(sources[0], 7, slice(2, 5), reads=True), sources[0].global_batch(7)[2:5])
    reads.clear()
    middle = stage_tokens(sources[0], 7, slice(2, 5), reads=False)  # a middle stage: no read, same shape
    assert not reads and middle.dtype == torch.int64 and tuple(middle.shape) == (3, 17) and not middle.any()


def test_prepare_byte_level_and_hf_tokenizer(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    done = prepare_files([text, text], tmp_path / "bytes.bin")
    assert done.vocab_size == 256 and done.tokens == 2 * len(TEXT.encode()) + 1  # documents joined by a newline
    assert bytes(np.asarray(TokenFile(tmp_path / "bytes.bin").tokens[:6], dtype=np.uint8)) == b"It was"
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    done = prepare_files([text], tmp_path / "hf.bin", tmp_path / "tokenizer.json")
    assert done.vocab_size == tok.get_vocab_size() and done.tokens == len(tok.encode(TEXT).ids)
    assert TokenFile(tmp_path / "hf.bin").tokens[0] == tok.token_to_id("It")


def test_cli_prepare_and_its_errors(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    out = tmp_path / "d.bin"
    ok = subprocess.run([FLASHFLEX, "data", "prepare", str(text), "--out", str(out), "--json"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["tokens"] == len(TEXT.encode()) and len(TokenFile(out)) == len(TEXT.encode())
    bad = subprocess.run([FLASHFLEX, "data", "prepare", str(tmp_path / "missing.txt"), "--out",
                          str(tmp_path / "e.bin")], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and "no such file" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "e.bin").exists()
    (tmp_path / "junk.json").write_text("{}")
    tok = subprocess.run([FLASHFLEX, "data", "prepare", str(text), "--out", str(tmp_path / "f.bin"),
                          "--tokenizer", str(tmp_path / "junk.json")], capture_output=True, text=True)
    assert tok.returncode == 2 and "cannot load tokenizer" in tok.stderr and not (tmp_path / "f.bin").exists()
