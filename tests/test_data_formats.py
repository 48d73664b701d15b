"""`flashflex data prepare` on the data people have: .txt, .jsonl, .parquet, globs, end-of-text separators,
--append, one-line errors naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashflex_cli.cli import main as cli_main
from flashflex_cli.data.prepare import prepare_files
from flashflex_cli.data.token_file import TokenFile

DOCS = ["The keeper lit the lamp.", "Ships passed in the night.", "Fog rolled over the rocks at dawn."]


def tokens(path: Path) -> list[int]:
    return [int(t) for t in np.asarray(TokenFile(path).tokens)]


def byte_join(docs: list[str]) -> list[int]:
    return list("\n".join(docs).encode())


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str | None], column: str = "text") -> Path:
    pq.write_table(pa.table({column: docs, "n": list(range(len(docs)))}), path, row_group_size=2)
    return path


def hf_tokenizer(folder: Path, eos: str | None = "<|endoftext|>") -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    special = ["[UNK]"] + ([eos] if eos else [])
    tok.train_from_iterator(DOCS, tokenizers.trainers.WordLevelTrainer(special_tokens=special))
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def test_txt_jsonl_parquet_and_globs_give_the_same_tokens(tmp_path: Path) -> None:
    (tmp_path / "txt").mkdir()
    for i, doc in enumerate(DOCS):
        (tmp_path / "txt" / f"{i}.txt").write_text(doc)
    write_jsonl(tmp_path / "a.jsonl", DOCS[:2])
    write_jsonl(tmp_path / "b.jsonl", DOCS[2:])
    write_parquet(tmp_path / "d.parquet", [DOCS[0], None, DOCS[1], DOCS[2]], column="body")
    want = byte_join(DOCS)
    txt = prepare_files([str(tmp_path / "txt" / "*.txt")], tmp_path / "txt.bin")
    assert tokens(tmp_path / "txt.bin") == want and txt.documents == 3 and txt.files == 3
    jsonl = prepare_files([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "jsonl.bin")
    assert tokens(tmp_path / "jsonl.bin") == want and jsonl.documents == 3
    par = prepare_files([tmp_path / "d.parquet"], tmp_path / "par.bin", column="body")  # the null row is skipped
    assert tokens(tmp_path / "par.bin") == want and par.documents == 3 and par.vocab_size == 256
    mixed = prepare_files([tmp_path / "a.jsonl", str(tmp_path / "**" / "2.txt")], tmp_path / "mixed.bin")
    assert tokens(tmp_path / "mixed.bin") == want and mixed.files == 2


def test_documents_are_separated_by_the_end_of_text_token(tmp_path: Path) -> None:
    tok_path = hf_tokenizer(tmp_path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    eot = tok.token_to_id("<|endoftext|>")
    write_jsonl(tmp_path / "d.jsonl", DOCS, field="content")
    summary = prepare_files([tmp_path / "d.jsonl"], tmp_path / "t.bin", tok_path, field="content")
    want = tok.encode(DOCS[0]).ids + [eot] + tok.encode(DOCS[1]).ids + [eot] + tok.encode(DOCS[2]).ids
    assert summary.separator == eot and tokens(tmp_path / "t.bin") == want
    assert TokenFile(tmp_path / "t.bin").vocab_size == tok.get_vocab_size()
    # --append continues the same file with a separator at the join
    more = prepare_files([tmp_path / "d.jsonl"], tmp_path / "t.bin", tok_path, field="content", append=True)
    assert more.tokens == 2 * len(want) + 1 and more.added == len(want) + 1
    assert tokens(tmp_path / "t.bin") == want + [eot] + want


def test_append_refuses_another_vocabulary(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    prepare_files([tmp_path / "d.jsonl"], tmp_path / "t.bin")
    before = (tmp_path / "t.bin").read_bytes()
    with pytest.raises(Exception, match="vocabulary 256"):
        prepare_files([tmp_path / "d.jsonl"], tmp_path / "t.bin", hf_tokenizer(tmp_path), append=True)
    assert (tmp_path / "t.bin").read_bytes() == before


@pytest.mark.parametrize("content,args,message", [
    ('{"text": "ok"}\n{"text": broken}\n', [], "bad.jsonl:2: malformed JSON"),
    ('{"text": "ok"}\n\n{"body": "x"}\n', [], "bad.jsonl:3: no string field 'text'"),
    ('{"text": "ok"}\n', ["--field", "body"], "bad.jsonl:1: no string field 'body'"),
    (b'{"text": "\xff\xfe"}\n', [], "bad.jsonl:1: not UTF-8"),
])
def test_corrupt_jsonl_line_is_one_line_naming_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             content: str | bytes, args: list[str],
                                                             message: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    code = cli_main(["data", "prepare", str(bad), "--out", str(tmp_path / "t.bin"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error:") and message in err, err
    assert not (tmp_path / "t.bin").exists() and [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


def test_bad_parquet_and_patterns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_parquet(tmp_path / "d.parquet", DOCS)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    cases = [
        ([str(tmp_path / "d.parquet"), "--column", "body"], "no column 'body' (columns: text, n"),
        ([str(tmp_path / "junk.parquet")], "junk.parquet: not a readable parquet file"),
        ([str(tmp_path / "ints.parquet")], "column 'text' holds int64"),
        ([str(tmp_path / "none-*.jsonl")], "matches no file"),
        ([str(tmp_path / "x.csv")], "unsupported file type .csv"),
        ([str(tmp_path)], "is a folder"),
    ]
    for args, message in cases:
        code = cli_main(["data", "prepare", *args, "--out", str(tmp_path / "t.bin")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and message in err, (args, err)
        assert not (tmp_path / "t.bin").exists()


def test_cli_json_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_parquet(tmp_path / "d.parquet", DOCS)
    assert cli_main(["data", "prepare", str(tmp_path / "*.parquet"), "--out", str(tmp_path / "t.bin"),
                     "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] == len(byte_join(DOCS)) == len(TokenFile(tmp_path / "t.bin"))
    assert summary["documents"] == 3 and summary["files"] == 1 and summary["separator"] == 10


def test_progress_reports_input_bytes(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from flashflex_cli.commands.data import progress_reporter

    files = [write_jsonl(tmp_path / f"{i}.jsonl", DOCS * 200) for i in range(2)]
    seen: list[tuple[int, int]] = []
    prepare_files([str(tmp_path / "*.jsonl")], tmp_path / "t.bin", progress=lambda d, t: seen.append((d, t)))
    total = sum(p.stat().st_size for p in files)
    assert seen[-1] == (total, total) and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:], strict=False))
    assert len(seen) > 2  # reported during the work, not only at the end
    console = Console(file=io.StringIO(), force_terminal=True, width=80)
    with progress_reporter(console) as report:
        assert report is not None
        report(5, 10)
    with progress_reporter(Console(file=io.StringIO(), force_terminal=False)) as report:
        assert report is None
