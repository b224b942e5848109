"""The command line as a user meets it: exit codes, one-line errors, JSON output."""

from __future__ import annotations

import json
import os
import sys

import pytest

from deltafs.testing.checkpoints import files_of, run_cli


def test_push_pull_verify_log_json(tmp_path, maker):
    store = tmp_path / "store"
    out = run_cli("push", maker.write(), store, "--json", "--meta", "step=0", check=0)
    first = json.loads(out.stdout)
    assert first["version"] == 1 and first["kind"] == "full" and first["bytes_written"] > 0 and first["full_bytes"] > 0
    maker.advance()
    src = maker.write()
    second = json.loads(run_cli("push", src, store, "--json", "--meta", "step=1", check=0).stdout)
    assert second["kind"] == "delta" and second["bytes_written"] < first["bytes_written"] / 5
    pulled = json.loads(run_cli("pull", store, tmp_path / "dest", "--json", check=0).stdout)
    assert pulled["version"] == 2 and pulled["status"] == "updated"
    assert files_of(tmp_path / "dest") == files_of(src)
    versions = json.loads(run_cli("log", store, "--json", check=0).stdout)["versions"]
    assert [(v["version"], v["kind"], v["metadata"]["step"]) for v in versions] == [(1, "full", 0), (2, "delta", 1)]
    assert versions[1]["ratio"] > 5 and 0 < versions[1]["changed_fraction"] < 0.05
    human = run_cli("log", store, check=0).stdout
    assert "full *" in human and "(HEAD)" in human
    assert json.loads(run_cli("verify", store, "--all", "--json", check=0).stdout)["ok"] is True
    run_cli("verify", store, "--local", tmp_path / "dest", check=0)


def test_quiet_prints_nothing(tmp_path, maker):
    proc = run_cli("push", maker.write(), tmp_path / "store", "--quiet", check=0)
    assert proc.stdout == "" and proc.stderr == ""


def test_pull_once_exit_codes(tmp_path, maker):
    store = tmp_path / "store"
    run_cli("push", maker.write(), store, check=0)
    assert run_cli("pull", store, tmp_path / "dest", "--once").returncode == 0
    assert run_cli("pull", store, tmp_path / "dest", "--once").returncode == 100
    proc = run_cli("pull", "--once", str(store), str(tmp_path / "dest"), "--version", "9")
    assert proc.returncode == 4 and "version 9 is not in" in proc.stderr


def test_pull_once_skips_while_another_pull_holds_the_lock(tmp_path, maker):
    import fcntl

    store = tmp_path / "store"
    run_cli("push", maker.write(), store, check=0)
    os.makedirs(tmp_path / "dest.deltafs")
    fd = os.open(tmp_path / "dest.deltafs" / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        proc = run_cli("pull", store, tmp_path / "dest", "--once")
        assert proc.returncode == 101 and "another deltafs process" in proc.stderr
    finally:
        os.close(fd)


def _one_line_error(proc, code, text):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltafs: error:") and text in lines[0], proc.stderr


def test_bad_inputs_get_one_line_errors(tmp_path, maker):
    store = tmp_path / "store"
    _one_line_error(run_cli("push", tmp_path / "nope", store), 2, "does not exist")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    _one_line_error(run_cli("push", bad, store), 2, "not a valid safetensors file")
    trunc_dir = tmp_path / "trunc"
    src = maker.write()
    os.makedirs(trunc_dir)
    data = open(os.path.join(src, "model.safetensors"), "rb").read()
    (trunc_dir / "model.safetensors").write_bytes(data[:-10])
    _one_line_error(run_cli("push", trunc_dir, store), 2, "truncated")
    assert not store.exists()  # nothing was written for a bad source
    _one_line_error(run_cli("pull", store, tmp_path / "d"), 3, "no deltafs store")
    _one_line_error(run_cli("push", src, store, "--storage-options", "{oops"), 2, "--storage-options is not valid JSON")
    _one_line_error(run_cli("push", src, "abfs://container/x"), 3, "no backend installed for abfs://")
    _one_line_error(_cli_without("s3fs", "push", src, "s3://bucket/x"), 3, "pip install s3fs (deltafs's [s3] extra)")
    _one_line_error(run_cli("push", src, "nosuchproto://x/y"), 3, "nosuchproto")


def _header_file(path, header: bytes, data: bytes = b"") -> str:
    import struct

    header += b" " * (-len(header) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return str(path.parent)


def test_headers_safetensors_loaders_refuse_are_refused(tmp_path):
    """What the safetensors format does not allow is refused at push (exit 2, one line, nothing written): a header
    nested too deeply for the JSON parser (was exit 1, a RecursionError), a tensor name given twice (json keeps the
    last one silently: the version held one of them), metadata values that are not strings."""
    store = tmp_path / "store"
    deep = _header_file(tmp_path / "deep" / "model.safetensors", b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}")
    _one_line_error(run_cli("push", deep, store), 2, "header is not JSON")
    entry = b'{"dtype":"F32","shape":[4],"data_offsets":[0,16]}'
    dup = _header_file(tmp_path / "dup" / "model.safetensors", b'{"a":' + entry + b',"a":' + entry + b"}", b"\0" * 16)
    _one_line_error(run_cli("push", dup, store), 2, "names 'a' twice")
    meta = _header_file(tmp_path / "meta" / "model.safetensors",
                        b'{"__metadata__":{"step":1},"a":' + entry + b"}", b"\0" * 16)
    _one_line_error(run_cli("push", meta, store), 2, "__metadata__ must map names to strings")
    assert not store.exists()
    ok = _header_file(tmp_path / "ok" / "model.safetensors", b'{"__metadata__":{"step":"1"},"a":' + entry + b"}",
                      b"\0" * 16)
    assert run_cli("push", ok, store).returncode == 0


def test_a_linked_folder_in_the_checkpoint_is_published(tmp_path, maker):
    """A folder linked into the checkpoint (a shared tokenizer) is published like a linked file (it was silently
    left out); a link back up the tree is not walked twice, with a warning."""
    src = tmp_path / "ck"
    os.makedirs(src)
    data = open(os.path.join(maker.write(), "model.safetensors"), "rb").read()
    (src / "model.safetensors").write_bytes(data)
    shared = tmp_path / "shared"
    os.makedirs(shared)
    (shared / "tokenizer.json").write_text('{"vocab": {}}')
    os.symlink(shared, src / "tok")
    os.symlink(src, shared / "loop")
    store = tmp_path / "store"
    proc = run_cli("push", src, store, "--json")
    assert proc.returncode == 0, proc.stderr
    assert "a link cycle" in proc.stderr
    dest = tmp_path / "dest"
    run_cli("pull", store, dest, check=0)
    assert sorted(os.listdir(dest)) == ["model.safetensors", "tok"]
    assert os.listdir(dest / "tok") == ["tokenizer.json"]
    assert (dest / "tok" / "tokenizer.json").read_text() == '{"vocab": {}}'


def _cli_without(module, *args):
    """The CLI in a process where `module` cannot be imported, as on a host without that extra."""
    code = f"import sys; sys.modules[{module!r}] = None; sys.argv = ['deltafs'] + sys.argv[1:]; from deltafs.cli.main import main; main()"
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=60)


def test_push_refuses_older_version_number(tmp_path, maker):
    store = tmp_path / "store"
    run_cli("push", maker.write(), store, "--version", "100", check=0)
    _one_line_error(run_cli("push", maker.write("b"), store, "--version", "100"), 2, "not newer")
    out = json.loads(run_cli("push", maker.write("c"), store, "--version", "150", "--json", check=0).stdout)
    assert out["version"] == 150 and out["parent"] == 100


def test_push_fold_writes_a_folded_delta(tmp_path, maker):
    store = tmp_path / "store"
    for _ in range(3):
        run_cli("push", maker.write(), store, "--fold", "-q", check=0)
        maker.advance()
    assert [p.name for p in sorted((store / "folds").iterdir())] == ["v0000000003.json"]
    run_cli("pull", store, tmp_path / "dest", check=0)
    run_cli("verify", store, "--local", tmp_path / "dest", check=0)


def test_log_lines_carry_an_iso_utc_timestamp(tmp_path, maker):
    """Cron appends stderr to a file: every log line says when it happened."""
    import re

    store, dest = tmp_path / "store", tmp_path / "dest"
    run_cli("push", maker.write(), store, "-q", check=0)
    run_cli("pull", store, dest, "-q", check=0)
    maker.advance()
    run_cli("push", maker.write(), store, "-q", check=0)
    env = {"DELTAFS_LOG_LEVEL": "INFO"}
    proc = run_cli("pull", store, dest, env=env, check=0)
    lines = [ln for ln in proc.stderr.splitlines() if "deltafs: " in ln and not ln.startswith("deltafs: ")]
    assert lines, proc.stderr
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ deltafs: [A-Z]+: ", ln) for ln in lines), lines


def test_log_level_is_deltafs_s_own_and_other_libraries_lines_name_them(monkeypatch, capsys):
    """DELTAFS_LOG_LEVEL=INFO turned on botocore's INFO lines (one per credential lookup), printed as
    `deltafs: INFO: ...`. Other libraries now log warnings only (all of it at DEBUG), under their own name; a
    level that is no level name is one line and exit 2 (it was a ValueError traceback)."""
    import logging

    from deltafs.cli import main as cli_main

    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.getLogger("deltafs").level
    try:
        monkeypatch.setenv("DELTAFS_LOG_LEVEL", "info")
        cli_main._setup_logging()
        logging.getLogger("deltafs.read.pull").info("pulled it")
        # another library's loggers (not botocore's own: other tests' imports configure those)
        logging.getLogger("otherlib.credentials").info("Found credentials in environment variables.")
        logging.getLogger("otherlib.endpoint").warning("slow down")
        err = capsys.readouterr().err.splitlines()
        assert [line.split(" ", 1)[1] for line in err] == ["deltafs: INFO: pulled it", "otherlib: WARNING: slow down"]
        monkeypatch.setenv("DELTAFS_LOG_LEVEL", "DEBUG")
        cli_main._setup_logging()
        logging.getLogger("otherlib.credentials").debug("signing")
        assert capsys.readouterr().err.split(" ", 1)[1] == "otherlib: DEBUG: signing\n"
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger("deltafs").setLevel(saved[2])
    for fine in ("warn", "FATAL", "", " info "):
        assert run_cli("version", env={"DELTAFS_LOG_LEVEL": fine}).returncode == 0, fine
    proc = run_cli("version", env={"DELTAFS_LOG_LEVEL": "loud"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("deltafs: error: DELTAFS_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
                           "not 'loud'\n")


def test_program_version_flag_and_command_version_option(tmp_path, maker):
    from deltafs import __version__

    assert run_cli("-V", check=0).stdout.strip() == f"deltafs {__version__}"
    assert run_cli("--version", check=0).stdout.strip() == f"deltafs {__version__}"
    store = tmp_path / "store"
    run_cli("push", maker.write(), store, "--version", "3", check=0)  # after a command, --version is the checkpoint's
    assert json.loads(run_cli("pull", store, tmp_path / "dest", "--version", "3", "--json", check=0).stdout)["version"] == 3
    assert run_cli("pull", store, tmp_path / "dest", "-v", "3").returncode == 2  # no -v anywhere


def test_pull_no_recycle_leaves_the_oldest_version_to_its_readers(tmp_path, maker):
    """`deltafs pull` rewrites the files of the version that falls out of the kept two; --no-recycle writes new
    files, so a process that still has the old file open keeps reading the old bytes."""
    store, dest = tmp_path / "store", tmp_path / "dest"
    sources = []
    for _ in range(4):
        sources.append(maker.write())
        run_cli("push", sources[-1], store, "-q", check=0)
        maker.advance()
    readers = {}
    for version, flag in ((3, ["--no-recycle"]), (4, [])):
        run_cli("pull", store, dest, "--version", str(version - 2), "-q", check=0)
        run_cli("pull", store, dest, "--version", str(version - 1), "-q", check=0)
        oldest = sorted(p for p in os.listdir(f"{dest}.deltafs") if p.startswith(f"v{version - 2:010d}-")
                        and not p.endswith(".json"))[0]
        fd = os.open(os.path.join(f"{dest}.deltafs", oldest, "model.safetensors"), os.O_RDONLY)
        try:
            run_cli("pull", store, dest, "--version", str(version), "-q", *flag, check=0)
            readers[version] = os.pread(fd, 1 << 20, 0)
        finally:
            os.close(fd)
        assert files_of(dest) == files_of(sources[version - 1])
    assert readers[3] == files_of(sources[0])["model.safetensors"]  # --no-recycle: the reader kept version 1
    assert readers[4] == files_of(sources[3])["model.safetensors"]  # default: version 2's file became version 4


def test_meta_numbers_json_cannot_hold_stay_text_and_a_large_delta_says_so(tmp_path):
    """--meta loss=NaN failed the whole push ("metadata is not JSON", exit 2) while loss=nan was kept as text; and a
    delta larger than its checkpoint was reported as "0.2x smaller than full"."""
    from deltafs.testing.checkpoints import write_safetensors

    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(str(src / "model.safetensors"), {"w": ("F32", (4,), bytes(16))})
    store = str(tmp_path / "store")
    out = json.loads(run_cli("push", src, store, "--json", "--meta", "loss=NaN", "--meta", "x=Infinity",
                             "--meta", "y=1e400", "--meta", "step=12", "--meta", "lr=1e-6", check=0).stdout)
    assert out["metadata"] == {"loss": "NaN", "x": "Infinity", "y": "1e400", "step": 12, "lr": 1e-6}
    write_safetensors(str(src / "model.safetensors"), {"w": ("F32", (4,), bytes(range(16)))})
    second = run_cli("push", src, store, check=0).stdout
    assert "smaller than full" not in second and "x the size of the full checkpoint" in second, second


def test_store_text_cannot_forge_lines_or_reach_the_terminal(tmp_path):
    """Paths, tensor names and metadata are the store's: printed raw, a newline forged an "ok: ... verified" line
    and ESC sequences cleared the screen or set the window title (adversarial pass)."""
    from deltafs.cli.output import one_line, terminal_safe
    from deltafs.testing.checkpoints import write_safetensors

    assert terminal_safe("a\x1b[2Jb\x07\tc\nd\x9b") == "a\\x1b[2Jb\\x07\tc\nd\\x9b"
    assert one_line("x\ny\tz") == "x\\ny\\tz"
    # Bidi overrides and isolates reorder what a terminal shows ("Trojan Source"): escaped like control characters.
    assert terminal_safe("step=\u202e1\u2066x\u200f") == "step=\\u202e1\\u2066x\\u200f"
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(str(src / "model.safetensors"), {"w\x1b]0;pwned\x07": ("F32", (2,), bytes(8))})
    store = str(tmp_path / "store")
    run_cli("push", src, store, "--meta", "step=1\nok: versions 1, 2 verified\x1b[2J", check=0)
    log = run_cli("log", store, check=0).stdout
    assert "\x1b" not in log and "step=1\\nok: versions 1, 2 verified\\x1b[2J" in log
    assert len(log.strip().splitlines()) == 2  # the header and version 1
    shown = run_cli("show", store, "--tensors", check=0).stdout
    assert "\x1b" not in shown and "\x07" not in shown and "w\\x1b]0;pwned\\x07" in shown


def test_a_push_whose_store_stops_answering_after_the_commit_still_succeeds(tmp_path, maker, monkeypatch, capsys):
    """The CLI read the new manifest back for its per-file sizes; a store unreachable right after the commit made
    a committed push exit 3, and a trainer retrying it pushes the step twice (adversarial pass, S3 and GCS)."""
    import sys

    from deltafs.cli import core
    from deltafs.cli.main import main
    from deltafs.errors import StoreError
    from deltafs.store.repo import Repository

    def unreachable(*args: object) -> None:
        raise StoreError("cannot read deltafs.json: connection refused after 5 attempts")

    monkeypatch.setattr(core, "_stored_bytes", unreachable)
    store = tmp_path / "store"
    monkeypatch.setattr(sys, "argv", ["deltafs", "push", maker.write(), str(store), "--json"])
    try:
        main()  # returns when the command succeeded without a code of its own
    except SystemExit as done:
        assert done.code in (0, None)
    captured = capsys.readouterr()
    pushed = json.loads(captured.out)
    assert pushed["version"] == 1 and pushed["files"] is None  # not known, not "no files"
    assert "version 1 is committed, but its stored sizes could not be read back" in captured.err
    assert Repository.open(str(store)).head().version == 1


def test_a_closed_stdout_is_exit_141_and_quiet(tmp_path, maker):
    """`deltafs verify STORE --all | head -0`: stdout closed before the result is written. click made that exit 1
    (an internal error, and `status`'s "unhealthy") with nothing on stderr; it is 141 now, as a shell reports a
    reader that went away, for every command that writes a result."""
    import subprocess

    from deltafs.errors import EXIT_OUTPUT_CLOSED

    store = str(tmp_path / "store")
    run_cli("push", maker.write(), store, check=0)
    exe = os.path.join(os.path.dirname(sys.executable), "deltafs")
    for args in (["verify", store, "--all"], ["log", store, "--json"], ["show", store], ["version"], ["--help"],
                 ["push", "--help"], []):
        read, write = os.pipe()
        os.close(read)
        try:
            proc = subprocess.run([exe, *args], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(write)
        assert proc.returncode == EXIT_OUTPUT_CLOSED and proc.stderr == "", (args, proc.returncode, proc.stderr)


def test_a_file_size_limit_or_a_read_only_sidecar_is_a_local_write_failure(tmp_path):
    """`ulimit -f` below a file of the version: "deltafs: error: File too large", exit 1 (an internal error); a
    directory of DEST's made unwritable (EACCES) was exit 1 too. Both are exit 12, as README's table says."""
    import subprocess

    import torch
    from safetensors.torch import save_file

    src = tmp_path / "ckpt"
    src.mkdir()
    save_file({"w": torch.randn(512, 1024)}, str(src / "model.safetensors"))  # 2 MiB
    store, dest = tmp_path / "store", tmp_path / "dest"
    run_cli("push", src, store, "-q", check=0)
    exe = os.path.join(os.path.dirname(sys.executable), "deltafs")
    proc = subprocess.run(["bash", "-c", f'ulimit -f 1024; exec "{exe}" pull "{store}" "{dest}"'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 12, proc.stderr
    assert proc.stderr.startswith("deltafs: error: cannot write ") and "File too large" in proc.stderr, proc.stderr
    assert "a file size limit" in proc.stderr and "free" not in proc.stderr, proc.stderr
    assert not dest.exists()
    from deltafs.errors import exit_code

    assert exit_code(PermissionError(13, "Permission denied")) == 12
    from deltafs.errors import local_write_error

    denied = local_write_error(PermissionError(13, "Permission denied", "/d.deltafs/chunks"), hint=" (free space ...)")
    assert str(denied) == "cannot use /d.deltafs/chunks: Permission denied (check its owner and permissions)"
    cache = local_write_error(PermissionError(13, "Permission denied", "/c/push"), hint=" (free space ...)",
                              elsewhere="or choose another push cache with --cache or DELTAFS_CACHE")
    assert str(cache) == ("cannot use /c/push: Permission denied (check its owner and permissions; or choose another "
                          "push cache with --cache or DELTAFS_CACHE)")
    from deltafs.cli.main import error_line

    assert error_line(PermissionError(13, "Permission denied", "/d.deltafs/chunks")) == (
        "deltafs: error: Permission denied: /d.deltafs/chunks (check its owner and permissions)", 12)


def test_verify_local_checks_a_version_gc_removed_from_the_store_against_what_was_pulled(tmp_path, maker):
    """A host a few versions behind: gc removed its version from the store, and `verify --local` failed its intact
    files with exit 6, "version 1 is not in STORE" (adversarial pass). They are checked against the manifest the
    pull recorded, which the next version names as its parent (its digest), with a warning; damage is still exit 6.
    With no version in the store naming it, nothing vouches for that record: exit 4, said as such."""
    store, dest = tmp_path / "store", tmp_path / "dest"
    run_cli("push", maker.write(), store, "-q", check=0)
    run_cli("pull", store, dest, "-q", check=0)
    maker.advance()
    run_cli("push", maker.write(), store, "-q", "--full", check=0)  # version 2: full, parent 1 (its bridge)
    maker.advance()
    run_cli("push", maker.write(), store, "-q", check=0)
    run_cli("gc", store, "--keep-last", "2", "--grace", "0", "-q", check=0)
    assert sorted(os.listdir(store / "manifests")) == ["v0000000002.json", "v0000000003.json"]
    proc = run_cli("verify", store, "--local", dest, check=0)
    assert "version 1 is no longer in" in proc.stdout and "which version 2 names as its parent" in proc.stdout
    report = json.loads(run_cli("verify", store, "--local", dest, "--json", check=0).stdout)
    assert report["ok"] and report["files_checked"] >= 1 and report["warnings"]
    victim = next(p for p in files_of(str(dest)) if p.endswith(".safetensors"))
    path = os.path.join(os.path.realpath(dest), victim)
    with open(path, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 1]))
    run_cli("verify", store, "--local", dest, check=6)
    maker.advance()
    run_cli("push", maker.write(), store, "-q", "--full", "--no-bridge", check=0)
    run_cli("gc", store, "--keep-last", "1", "--grace", "0", "-q", check=0)
    proc = run_cli("verify", store, "--local", dest, check=4)
    assert "no version there names it as its parent" in proc.stderr


def test_a_metadata_key_given_twice_is_refused(tmp_path, maker):
    """`--meta k=a --meta k=b` kept "b" without a word (adversarial pass); so did a key in both --metadata and --meta."""
    store = tmp_path / "store"
    proc = run_cli("push", maker.write(), store, "--meta", "k=a", "--meta", "k=b", check=2)
    assert proc.stderr.strip() == "deltafs: error: --meta k is given twice ('a' and 'b'); give each key once"
    proc = run_cli("push", maker.write(), store, "--metadata", '{"k": 1}', "--meta", "k=2", check=2)
    assert "--meta k is also in --metadata" in proc.stderr
    assert not store.exists()


def test_a_store_path_with_a_name_too_long_is_said_as_such(tmp_path, maker):
    """A 300-byte store name gave "cannot read deltafs.json at ...: File name too long" (exit 3), as if there were a
    store to read (adversarial pass)."""
    store = tmp_path / ("s" * 300)
    for args in (("push", maker.write(), store), ("log", store), ("pull", store, tmp_path / "dest")):
        proc = run_cli(*args, check=2)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "a name in its path is 300 bytes long, and this filesystem allows at most 255" in proc.stderr


def test_a_filesystem_that_reports_no_name_limit_still_takes_stores(tmp_path, monkeypatch):
    """pathconf answers -1 (not known) or 0 (some FUSE filesystems): every store path was refused (review)."""
    from deltafs.store import local

    for answer in (-1, 0):
        monkeypatch.setattr(local.os, "pathconf", lambda path, name, answer=answer: answer)
        local._check_name_lengths(str(tmp_path / "a" / "store"), "store")
        with pytest.raises(Exception, match="is 300 bytes long, and this filesystem allows at most 255"):
            local._check_name_lengths(str(tmp_path / ("s" * 300)), "store")
