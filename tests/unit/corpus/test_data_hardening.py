"""Issue 36 item 4: `data prepare` in a directory others can write follows no planted symbolic link (its
temporaries are private random names, its final names are hard-linked, which refuses any name that exists), and
FIFOs, sockets and devices given as input (FILES, `--tokenizer`, the files of `render/rollout run --data`) are
refused with one `error:` line and exit 2, never read (each such run is a subprocess with a timeout, so a hang
fails the test). A malformed PREFIX.json read by `render`/`rollout run --data` is one `error:` line, exit 2.

Outcomes, by design: links planted at temporary-looking names are ignored (exit 0, their targets untouched); a
link planted at a final name (PREFIX.bin, .idx, .json, .tokenizer.json) is an existing name, refused with exit 2
(a dataset is never overwritten), its target untouched."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepdeploy import corpus
from stepdeploy.cli.app import main
from stepdeploy.corpus.output import Outputs
from stepdeploy.errors import BadInput

TIMEOUT_S = 20
SIM_INI = ("[sim]\nnode1 ansible_host=10.83.0.11\nnode2 ansible_host=10.83.0.12\n[sim:vars]\nansible_user=root\n"
           "stepdeploy_gpus_per_node=0\nstepdeploy_profile=sim-cpu\nstepdeploy_train_iface=eth0\n"
           "stepdeploy_fabric=ethernet\n")
TEXT = "The soak trains on text that does not repeat; every byte one token, or a merge of them.\n" * 40


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    return int(exited.value.code or 0), capsys.readouterr().err


def stepdeploy(*argv: str) -> tuple[int, str]:
    """The CLI in a subprocess: a read that blocks fails the test after TIMEOUT_S instead of hanging it."""
    res = subprocess.run([sys.executable, "-m", "stepdeploy", *argv], capture_output=True, text=True,
                         timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    return res.returncode, res.stderr


def one_error(code: int, err: str, says: str) -> None:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("warning: ", "note: "))]
    assert code == 2 and lines and lines[0].startswith("error: ") and says in lines[0], err
    assert len(lines) <= 2 and all(line.startswith("hint: ") for line in lines[1:]), err
    assert "Traceback" not in err


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o1777)
    return directory


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "a.txt"
    path.write_text(TEXT)
    return path


def plant(shared: Path, victims: Path, names: list[str]) -> dict[Path, bytes]:
    victims.mkdir(exist_ok=True)
    planted = {}
    for name in names:
        victim = victims / f"victim-{name}"
        victim.write_bytes(b"not yours\n")
        (shared / name).symlink_to(victim)
        planted[victim] = victim.read_bytes()
    return planted


# --- (a) symbolic links in a shared output directory --------------------------------------------------------


def test_links_at_every_temporary_looking_name_are_ignored(tmp_path: Path, shared: Path, text: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    names = [f"{stem}{suffix}{tail}" for stem in ("corpus", ".corpus") for suffix in
             (".bin", ".idx", ".json", ".tokenizer.json") for tail in (".tmp", ".tmp.0", "")
             if tail or stem == ".corpus"] + ["corpus.tmp", "corpus"]
    victims = plant(shared, tmp_path / "outside", names)
    code, err = run_main(["data", "prepare", str(text), "--train-tokenizer", "300", "--out",
                          str(shared / "corpus")], capsys)
    assert code == 0, err
    assert all(victim.read_bytes() == content for victim, content in victims.items())
    for suffix in (".bin", ".idx", ".json", ".tokenizer.json"):
        info = os.lstat(shared / f"corpus{suffix}")
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o644
    assert corpus.load_prepared(shared / "corpus").tokenizer.kind == "trained-bpe"
    leftovers = {p.name for p in shared.iterdir()} - set(names) - {f"corpus{s}" for s in
                                                                   (".bin", ".idx", ".json", ".tokenizer.json")}
    assert not leftovers  # no temporary left behind


@pytest.mark.parametrize("suffix", [".bin", ".idx", ".json", ".tokenizer.json"])
def test_a_link_at_a_final_name_is_refused_and_its_target_untouched(tmp_path: Path, shared: Path, text: Path,
                                                                    suffix: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    victims = plant(shared, tmp_path / "outside", [f"corpus{suffix}"])
    dangling = tmp_path / "outside" / "created-through-the-link"
    (shared / f"next{suffix}").symlink_to(dangling)
    for prefix in ("corpus", "next"):
        code, err = run_main(["data", "prepare", str(text), "--train-tokenizer", "300", "--out",
                              str(shared / prefix)], capsys)
        one_error(code, err, f"{prefix}{suffix} exists")
    assert all(victim.read_bytes() == content for victim, content in victims.items())
    assert not dangling.exists()
    assert sorted(p.name for p in shared.iterdir()) == sorted([f"corpus{suffix}", f"next{suffix}"])


def test_a_link_planted_at_a_final_name_while_writing_is_refused(tmp_path: Path, shared: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours\n")
    with pytest.raises(BadInput, match="appeared while the dataset was written"), Outputs(shared / "c") as outputs:
        outputs.write(".bin", b"data")
        (shared / "c.bin").symlink_to(victim)
        outputs.commit([".bin"])
    assert victim.read_bytes() == b"not yours\n"
    assert [p.name for p in shared.iterdir()] == ["c.bin"] and (shared / "c.bin").is_symlink()


def test_a_temporary_swapped_for_a_link_is_caught_and_nothing_is_left(tmp_path: Path, shared: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours\n")
    with pytest.raises(BadInput, match="its temporary was replaced"), Outputs(shared / "c") as outputs:
        outputs.write(".bin", b"data")
        name = outputs.temporaries[".bin"][0]
        os.rename(shared / name, tmp_path / "moved-away")
        (shared / name).symlink_to(victim)
        outputs.commit([".bin"])
    assert victim.read_bytes() == b"not yours\n"
    assert not (shared / "c.bin").exists() and not (shared / "c.bin").is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's link needs root (lchown)")
def test_another_users_link_in_a_shared_directory_is_not_followed(tmp_path: Path, shared: Path, text: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (shared / "data").symlink_to(elsewhere)
    os.lchown(shared / "data", 4242, 4242)  # planted by someone else
    code, err = run_main(["data", "prepare", str(text), "--out", str(shared / "data" / "corpus")], capsys)
    one_error(code, err, "a symbolic link owned by uid 4242")
    code, err = run_main(["data", "prepare", str(text), "--out", str(shared / "data" / "new" / "corpus")], capsys)
    one_error(code, err, "a symbolic link owned by uid 4242")
    assert list(elsewhere.iterdir()) == []
    (shared / "mine").symlink_to(elsewhere)  # our own link: followed, as the kernel would
    code, err = run_main(["data", "prepare", str(text), "--out", str(shared / "mine" / "corpus")], capsys)
    assert code == 0, err
    assert corpus.load_prepared(elsewhere / "corpus").documents == 1


# --- (b) FIFOs, sockets and devices as input ----------------------------------------------------------------


@contextlib.contextmanager
def special(path: Path, kind: str) -> Iterator[Path]:
    """`path` made a FIFO, a listening socket, or a link to a character device."""
    if kind == "fifo":
        os.mkfifo(path)
        yield path
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(str(path))
            sock.listen(1)
            yield path
    else:
        path.symlink_to("/dev/zero")  # an input's link is followed: to a device, refused
        yield path


@pytest.mark.parametrize(("kind", "says"), [("fifo", "a FIFO"), ("socket", "a socket"),
                                            ("device", "a character device")])
def test_special_files_given_to_prepare_are_refused(tmp_path: Path, text: Path, kind: str, says: str) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text(TEXT)
    with special(tmp_path / "s", kind) as given:
        one_error(*stepdeploy("data", "prepare", str(text), str(given), "--out", str(tmp_path / "c")), says)
    with special(tmp_path / "dir" / "s", kind) as inside:
        one_error(*stepdeploy("data", "prepare", str(tmp_path / "dir"), "--out", str(tmp_path / "c")),
                  f"{inside}: {says}")
    assert not list(tmp_path.glob("c*"))


def test_a_fifo_given_as_the_tokenizer_is_refused(tmp_path: Path, text: Path) -> None:
    os.mkfifo(tmp_path / "tokenizer.json")
    for given in (tmp_path / "tokenizer.json", tmp_path):
        one_error(*stepdeploy("data", "prepare", str(text), "--tokenizer", str(given), "--out", str(tmp_path / "c")),
                  "not a regular file (a FIFO")


def prepared(tmp_path: Path) -> Path:
    (tmp_path / "inv.ini").write_text(SIM_INI)
    (tmp_path / "t.txt").write_text(TEXT)
    corpus.prepare([tmp_path / "t.txt"], tmp_path / "c")
    return tmp_path / "c"


def data_commands(tmp_path: Path, prefix: Path) -> list[list[str]]:
    inventory = str(tmp_path / "inv.ini")
    return [["render", "-i", inventory, "-m", "tiny-dense", "--out", str(tmp_path / "run"), "--data", str(prefix)],
            ["rollout", "run", "-i", inventory, "-m", "tiny-dense", "--dry-run", "--data", str(prefix)]]


@pytest.mark.parametrize(("suffix", "kind"), [(".json", "fifo"), (".bin", "fifo"), (".idx", "fifo"),
                                              (".json", "socket"), (".bin", "device")])
def test_special_files_in_a_dataset_given_to_render_and_rollout_are_refused(tmp_path: Path, suffix: str,
                                                                            kind: str) -> None:
    prefix = prepared(tmp_path)
    Path(f"{prefix}{suffix}").unlink()
    with special(Path(f"{prefix}{suffix}"), kind):
        for command in data_commands(tmp_path, prefix):
            one_error(*stepdeploy(*command), f"c{suffix}: ")
    assert not (tmp_path / "run").exists()


# --- (c) malformed descriptions read by render / rollout run --data ----------------------------------------


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


MALFORMED: list[tuple[str, object, str]] = [
    ("a list", ["vocab", 257], "the document: Input should be a valid dictionary"),
    ("a string", "byte", "the document"),
    ("null", None, "the document"),
    ("vocab a string", {"vocab": "x"}, "vocab: Input should be a valid integer"),
    ("vocab a float", {"vocab": 257.0}, "vocab"),
    ("documents a bool", {"documents": True}, "documents"),
    ("a huge number", {"tokens": 10**30}, "tokens: Input should be less than or equal to"),
    ("thousands of digits", {"tokens": "1" * 5000}, "not a JSON dataset description"),
    ("infinity", {"vocab": "Infinity"}, "vocab"),
    ("nested junk", {"tokenizer": {"kind": {"a": [1, {"b": None}]}}}, "tokenizer"),
    ("nested past the bound", {"sha256": nested(200)}, "nested deeper than"),
    ("a key with a newline", {"tokenizer": {"kind": "byte", "name": "byte", "vocab": 257, "eod": 256,
                                            "evil\n\x1b[31mkey": 1}}, "evil\\n\\x1b[31mkey"),
    ("a key of a megabyte", {"tokenizer": {"kind": "byte", "name": "byte", "vocab": 257, "eod": 256,
                                           "k" * 100_000: 1}}, "kkk..."),
    ("tokenizer missing", {"tokenizer": None}, "tokenizer"),
    ("max_id below eod", {"max_id": 3}, "below the end-of-document id"),
    ("checksums a list", {"sha256": ["a", "b"]}, "sha256"),
]


def malformed(prefix: Path, change: object) -> None:
    meta = Path(f"{prefix}.json")
    good = json.loads(meta.read_text())
    if isinstance(change, dict):
        data = {key: value for key, value in {**good, **change}.items() if value is not None}
        text = json.dumps(data)
        for key, value in change.items():  # bare JSON words and digits json.dumps would quote
            if isinstance(value, str) and (value == "Infinity" or value.isdigit()):
                text = text.replace(json.dumps({key: value})[1:-1], f'"{key}": {value}')
    else:
        text = json.dumps(change)
    meta.write_text(text)


@pytest.mark.parametrize(("name", "change", "says"), MALFORMED, ids=[case[0] for case in MALFORMED])
def test_a_malformed_description_is_one_error_line_for_render_and_rollout(tmp_path: Path, name: str,
                                                                          change: object, says: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    prefix = prepared(tmp_path)
    malformed(prefix, change)
    for command in data_commands(tmp_path, prefix):
        code, err = run_main(command, capsys)
        one_error(code, err, says)
        assert len(err) < 1000 and "\x1b" not in err
    assert not (tmp_path / "run").exists()
