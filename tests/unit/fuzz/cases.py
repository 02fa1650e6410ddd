"""Hypothesis strategies for the CLI fuzz suite: every command and option of `stepdeploy`, fed generated bad
input, hostile values and corrupt files.

A strategy draws a `Case`: the files of a scratch directory (inventories with their group_vars/host_vars,
rollout ledgers, run manifests, NCCL facts, FIFOs, links, special files) and an argv that points at them with
relative paths. Nothing drawn here touches the machine: `Case.make(directory)` writes the files. Values that
would be valid and slow or harmful for real (`sim up` with a valid node count, `demo`, SSH to a node that
answers) are never drawn: every address is on 127.0.0.0/8 at a port nothing listens on.

Set STEPDEPLOY_FUZZ_WIDE=1 (bench/fuzz_cli.py does) for the slower kinds: provisioning runs, rollouts that
render and try to launch, preflight --local with its bandwidth sweep, bigger files.
"""

from __future__ import annotations

import json
import math
import os
import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

WIDE = os.environ.get("STEPDEPLOY_FUZZ_WIDE") == "1"

# --- values -------------------------------------------------------------------------------------------------

HOSTILE = [
    "", " ", "\n", "a\nb", "x\n", "\t", "\x1b[31mred\x1b[0m", "\x1b]0;title\x07", "\x1b[2J", "\x9b31m", "[/x]",
    "[bold red]x", "[link=file:///etc/passwd]x[/link]", "$(touch PWNED)", "`touch PWNED`", "'; touch PWNED; '",
    "\"; touch PWNED; \"", "a;touch PWNED", "{{ lookup('pipe', 'touch PWNED') }}", "{% if x %}", "../../etc/passwd",
    "/etc/passwd", "-rf", "--help", "-h", "*", "~", "~nosuchuser/x", "é", "日本語", "\u202ereversed", "\udcff",
    "a" * 3000, "nan", "NaN", "inf", "-inf", "Infinity", "-1", "0", "1e309", "1e-320", "99999999999999999999999",
    "0x10", "0b1", "²", "\u0661", "Ⅻ", " 8", "8 ", "None", "null", "true", "no", "[1, 2]", "{a: 1}", "&a", "*a",
    "!!python/object/apply:os.system ['touch PWNED']", "%s%n%x", "\\", "a,b,,c", "=", "a=b=c", ",", "@", ":",
    "node1", "127.0.0.1", "::1", "tiny-dense", "H200", "warmup", "slurm", "fabric", "sim-cpu",
]
NUMBERS = ["0", "-1", "1", "2", "3", "8", "64", "65", "100000", "100001", "1000000000", "18446744073709551617",
           "nan", "inf", "-inf", "1e309", "0.5", "-0.0", "1e-9", "²", "\u0661", "0x10", "", " 1", "1 ", "1_000", "NaN"]


def hostile() -> st.SearchStrategy[str]:
    weird = st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from("\x00\x1b\x07\n\r[]/$`'\"\\;")
    return st.sampled_from(HOSTILE) | st.text(weird, max_size=24)


PLAUSIBLE = ["1", "2", "4", "8", "16", "64", "0.5", "10"]


def number() -> st.SearchStrategy[str]:
    """Two times in five a plausible number (so what comes after an option's check is reached too)."""
    plausible = st.sampled_from(PLAUSIBLE)
    return st.one_of(plausible, plausible, st.sampled_from(NUMBERS), st.integers(-(2**70), 2**70).map(str),
                     st.floats(allow_nan=True, allow_infinity=True).map(repr))


def value() -> st.SearchStrategy[str]:
    return number() | hostile()


# --- files --------------------------------------------------------------------------------------------------

Maker = Callable[[Path], None]


@dataclass
class Case:
    """Files to make (path relative to the case directory -> how) and the argv to run there."""

    argv: list[str]
    files: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def make(self, root: Path) -> None:
        for fixture in ("existing-file", "existing-dir/keep", "fifo"):
            self.files.setdefault(fixture, ("fifo",) if fixture == "fifo" else ("text", "x\n"))
        for rel, spec in self.files.items():
            try:
                _make(root / rel, spec)
            except (ValueError, OSError):  # a drawn name no file system takes (NUL, too long): no such file
                continue


def _make(path: Path, spec: tuple[Any, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = spec[0]
    if path.exists() or path.is_symlink():
        return
    if kind == "text":
        path.write_text(spec[1], encoding="utf-8", errors="surrogateescape")
    elif kind == "bytes":
        path.write_bytes(spec[1])
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(spec[1])
    elif kind == "ledger":
        make_ledger(path, spec[1])
    else:
        raise ValueError(kind)


def _ini(hosts: list[tuple[str, dict[str, Any]]], group_vars: dict[str, Any]) -> str:
    def word(v: Any) -> str:
        text = str(v)
        return text if text and not any(c in text for c in " \t'\"#;=") else "'" + text.replace("'", "") + "'"

    lines = ["[cluster]"]
    lines += [" ".join([name, *(f"{k}={word(v)}" for k, v in variables.items())]) for name, variables in hosts]
    lines += ["", "[cluster:vars]", *(f"{k}={word(v)}" for k, v in group_vars.items())]
    return "\n".join(lines) + "\n"


def _yaml_inventory(hosts: list[tuple[str, dict[str, Any]]], group_vars: dict[str, Any]) -> str:
    document = {"all": {"children": {"cluster": {"hosts": dict(hosts), "vars": group_vars}}}}
    return yaml.safe_dump(document, allow_unicode=True)


def laughs(levels: int = 9) -> str:
    lines = ['lol0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"lol{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


GOOD_VARS = {
    "cpu": {"stepdeploy_profile": "sim-cpu", "stepdeploy_gpus_per_node": 0, "stepdeploy_fabric": "ethernet",
            "stepdeploy_train_iface": "eth0"},
    "gpu": {"stepdeploy_profile": "hopper-cu128", "stepdeploy_gpus_per_node": 8, "stepdeploy_gpu_model": "H200",
            "stepdeploy_fabric": "infiniband", "stepdeploy_ib_hcas": "mlx5_0,mlx5_1"},
}
VARIABLES = ["stepdeploy_gpus_per_node", "stepdeploy_gpu_model", "stepdeploy_arch", "stepdeploy_train_iface",
             "stepdeploy_fabric", "stepdeploy_ib_hcas", "stepdeploy_profile", "stepdeploy_ssh_known_hosts",
             "stepdeploy_executor", "stepdeploy_slurm_controller", "stepdeploy_slurm_partition",
             "stepdeploy_slurm_tasks", "stepdeploy_typo", "ansible_host", "ansible_ssh_host", "ansible_port",
             "ansible_ssh_port", "ansible_user", "ansible_ssh_user", "ansible_ssh_private_key_file",
             "ansible_private_key_file", "ansible_connection", "ansible_ssh_common_args", "ansible_ssh_extra_args",
             "ansible_ssh_args", "ansible_host_key_checking", "ansible_ssh_host_key_checking"]
SSH_ARGS = ["-o StrictHostKeyChecking=no", "-o StrictHostKeyChecking=yes", "-J bastion", "-J 'x;y'",
            "-o ProxyJump=a@b:99999", "-o UserKnownHostsFile=/dev/null", "-o 'unbalanced", "-oProxyCommand=touch PWNED"]


@st.composite
def inventory_files(draw: st.DrawFn, name: str = "inv") -> tuple[str, dict[str, Any]]:
    """(the inventory's file name, the files: the inventory, maybe group_vars/ and host_vars/ and facts)."""
    shape = draw(st.sampled_from(["cpu", "gpu"]))
    hosts = []
    for i in range(draw(st.integers(1, 3))):
        clean = draw(st.integers(0, 9)) < 6  # most inventories load: the options behind them get their turn
        host = f"n{i + 1}" if clean else draw(st.sampled_from([f"n{i + 1}", "localhost"]) | hostile())
        variables: dict[str, Any] = {"ansible_host": f"127.0.0.{i + 1}", "ansible_port": draw(st.sampled_from([1, 9]))}
        for _ in range(0 if clean else draw(st.integers(0, 2))):
            key = draw(st.sampled_from(VARIABLES))
            variables[key] = draw(st.sampled_from(SSH_ARGS) if key.endswith("_args") else value())
        hosts.append((host, variables))
    group_vars = dict(GOOD_VARS[shape])
    if draw(st.integers(0, 3)) == 0:
        group_vars[draw(st.sampled_from(VARIABLES))] = draw(value() | st.sampled_from(SSH_ARGS))
    style = draw(st.sampled_from(["ini"] * 6 + ["yml"] * 5 + ["bomb", "deep", "binary", "empty", "fifo", "dir"]))
    suffix = "yml" if style in ("yml", "bomb", "deep") else "ini"
    path = f"{name}.{suffix}"
    files: dict[str, Any] = {}
    if style == "ini":
        files[path] = ("text", _ini(hosts, group_vars))
    elif style == "yml":
        files[path] = ("text", _yaml_inventory(hosts, group_vars))
    elif style == "bomb":
        files[path] = ("text", _yaml_inventory(hosts, group_vars) + "\n".join("x_" + line for line in
                                                                             laughs().splitlines()) + "\n")
    elif style == "deep":
        files[path] = ("text", "all:\n  vars:\n    x: " + "[" * 400 + "]" * 400 + "\n")
    elif style == "binary":
        files[path] = ("bytes", bytes(draw(st.lists(st.integers(0, 255), max_size=200))))
    elif style in ("empty", "fifo", "dir"):
        files[path] = {"empty": ("text", ""), "fifo": ("fifo",), "dir": ("dir",)}[style]
    files.update(draw(vars_dirs(hosts)))
    files.update(draw(facts_files([h for h, _ in hosts])))
    return path, files


@st.composite
def vars_dirs(draw: st.DrawFn, hosts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    kind = draw(st.sampled_from(["none"] * 16 + ["yaml", "bomb", "fifo", "deep", "binary", "dir", "loop", "host"]))
    variables = {draw(st.sampled_from(VARIABLES)): draw(value())}
    return {
        "none": {},
        "yaml": {"group_vars/all.yml": ("text", yaml.safe_dump(variables, allow_unicode=True))},
        "bomb": {"group_vars/cluster.yml": ("text", laughs())},
        "fifo": {"group_vars/all.yml": ("fifo",)},
        "deep": {"group_vars/all.yml": ("text", "x: " + "{a: " * 300 + "1" + "}" * 300 + "\n")},
        "binary": {"group_vars/all.yml": ("bytes", b"\xff\xfe\x00garbage: [")},
        "dir": {"group_vars/all.yml/inner.yml": ("text", "stepdeploy_gpus_per_node: 2\n")},
        "loop": {"group_vars/all/loop": ("symlink", "..")},
        "host": {f"host_vars/{hosts[0][0].replace('/', '_') or 'x'}.yml": ("text", yaml.safe_dump(variables))},
    }[kind]


@st.composite
def facts_files(draw: st.DrawFn, names: list[str]) -> dict[str, Any]:
    kind = draw(st.sampled_from(["none"] * 12 + ["good", "deep", "types", "hostile", "fifo", "dir", "garbage"]))
    if kind == "none" or not names[0] or "/" in names[0] or "\x00" in names[0]:
        return {}
    path = f".stepdeploy/facts/{names[0]}.json"
    hostile_value = draw(value())
    return {path: {
        "good": ("text", json.dumps({"socket_ifname": "eth0", "ib_hca": "mlx5_0:1", "gid_index": 3})),
        "deep": ("text", "[" * 5000 + "]" * 5000),
        "types": ("text", json.dumps({"socket_ifname": 7, "gid_index": "x", "gid_indexes": {"a": 1}})),
        "hostile": ("text", json.dumps({"socket_ifname": hostile_value, "ib_hca": hostile_value})),
        "fifo": ("fifo",), "dir": ("dir",), "garbage": ("bytes", b"{\"socket_ifname\": \xff"),
    }[kind]}


LEDGER_KINDS = ["good"] * 5 + ["nan", "random", "truncated", "flipped", "foreign", "newer", "types", "config",
                                "unknown-stage", "fifo", "dir", "empty", "v1"]


@st.composite
def ledger_spec(draw: st.DrawFn, inventory: str) -> tuple[str, Any]:
    kind = draw(st.sampled_from(LEDGER_KINDS))
    config = {"inventory": inventory, "model": draw(st.sampled_from(["tiny-dense", "tiny-moe"]) | hostile()),
              "stages": ["warmup"], "warmup_iterations": 2}
    if draw(st.booleans()):
        config[draw(st.sampled_from(["layout", "seq_length", "executor", "thresholds", "inject", "zzz"]))] = \
            draw(value() | st.builds(dict) | st.lists(hostile(), max_size=2))
    return "ledger", {"kind": kind, "run_id": draw(st.sampled_from(["r1"] * 3) | hostile()),
                      "reason": draw(hostile()), "config": config, "running": draw(st.booleans()),
                      "seed": draw(st.integers(0, 2**32))}


def make_ledger(path: Path, spec: dict[str, Any]) -> None:
    from stepdeploy.ledger import Ledger

    kind, rng = spec["kind"], random.Random(spec["seed"])
    if kind in ("fifo", "dir", "empty", "random"):
        {"fifo": os.mkfifo, "dir": Path.mkdir, "empty": Path.touch,
         "random": lambda p: p.write_bytes(rng.randbytes(rng.randint(1, 9000)))}[kind](path)
        return
    if kind == "foreign":
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE runs (id INTEGER, config BLOB)")
            db.execute("INSERT INTO runs VALUES (1, x'00ff')")
        return
    led = Ledger(path)
    run_id = spec["run_id"]
    led.create_run(run_id, spec["config"], ["bake"] if kind == "unknown-stage" else ["warmup"])
    led.set_stage(run_id, "bake" if kind == "unknown-stage" else "warmup", "running")
    attempt = led.start_attempt(run_id, "warmup", "target", {"local_run": "attempts/warmup-target-a1"})
    second = math.nan if kind == "nan" else 4.0
    led.add_metrics(run_id, attempt, [(1.0, 0, 1, "loss", 5.0), (2.0, 0, 2, "loss", second)])
    led.verdict(run_id, "warmup", "target", "loss_finite", False, [2], "finite loss", spec["reason"])
    if not spec["running"]:
        led.finish_attempt(attempt, "failed", {"reason": spec["reason"]})
    led.close()
    with sqlite3.connect(path) as db:
        if kind == "newer":
            db.execute("UPDATE meta SET value = '99'")
        elif kind == "types":
            db.execute("UPDATE attempts SET started = 'soon'")
        elif kind == "config":
            db.execute("UPDATE runs SET config = ?", (rng.choice(["{", "[]", "{\"stages\": 5}", "null"]),))
        elif kind == "v1":
            db.executescript("DELETE FROM metrics WHERE value IS NULL; UPDATE meta SET value = '1'; "
                             "ALTER TABLE metrics DROP COLUMN nonfinite;")
    if kind in ("truncated", "flipped"):
        data = bytearray(path.read_bytes())
        if kind == "truncated":
            data = data[: rng.randint(0, len(data) - 1)]
        else:
            for _ in range(rng.randint(1, 40)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        path.write_bytes(bytes(data))


@st.composite
def manifest_spec(draw: st.DrawFn, inventory: str, names: list[str]) -> tuple[str, Any]:
    manifest: dict[str, Any] = {
        "format": 1, "run_id": "r1", "run_dir": "/var/lib/stepdeploy/runs/r1", "engine": "torch", "stage": "warmup",
        "inputs": {"inventory": {"path": inventory}},
        "nodes": [{"name": n, "address": f"127.0.0.{i + 1}", "node_rank": i, "dir": f"nodes/{i}-n{i + 1}"}
                  for i, n in enumerate(names)],
        "files": [],
    }
    kind = draw(st.sampled_from(["good"] * 4 + ["drop", "value", "slurm", "garbage", "deep", "fifo", "dir"]))
    if kind == "drop":
        manifest.pop(draw(st.sampled_from(sorted(manifest))))
    elif kind == "value":
        where = draw(st.sampled_from(["run_id", "run_dir", "nodes", "inputs", "format", "executor", "node-dir",
                                      "node-name"]))
        bad = draw(value() | st.integers() | st.lists(hostile(), max_size=2) | st.none())
        if where == "node-dir":
            manifest["nodes"][0]["dir"] = bad
        elif where == "node-name":
            manifest["nodes"][0]["name"] = bad
        else:
            manifest[where] = bad
    elif kind == "slurm":
        manifest |= {"executor": "slurm", "slurm": {"script": "sbatch.sh", "job_name": draw(hostile()),
                                                     "tasks": "node", "tasks_per_node": 1}}
    text = json.dumps(manifest, allow_nan=True)
    return {"garbage": ("bytes", b"{\"format\": 1, \xff"), "deep": ("text", "[" * 9000 + "]" * 9000),
            "fifo": ("fifo",), "dir": ("dir",)}.get(kind, ("text", text))


# --- argv -----------------------------------------------------------------------------------------------------

OUT_PATHS = ["out", "runs/new", "nested/deeper/out", "existing-file", "existing-dir", "fifo", "/dev/null",
             "/proc/stepdeploy-fuzz/out", "/sys/stepdeploy-fuzz", "", ".", "existing-file/under", "[/x]", "a\nb",
             "-rf", "$(touch PWNED)", "\x1b[2J"]
MODELS = ["tiny-dense", "tiny-moe"] * 3 + ["nope", "", "TINY-DENSE", "[/x]", "../x"] + (["proxy-0.7b-dense"] if WIDE
                                                                                     else [])
GPUS = ["H100", "H200", "B200", "GB10", "h200", "", "A100", "[/x]"]
LINKS = ["ib-400g", "roce-200g", "ethernet-tcp", "nvlink4", "", "x"]
LAYOUT_KEYS = ["tp", "pp", "vpp", "cp", "ep", "etp", "mbs", "recompute", "dist-opt", "offload", "sp", "ce-fusion",
               "first", "last", "dispatcher", "grouped_gemm", "overlap_grad_reduce", "zz", "", "tp "]
LAYOUT_VALUES = ["1", "2", "4", "8", "0", "-1", "²", "\u0661", "x", "on", "off", "full", "selective", "none", "flex",
                 "", "999999999", "1e3"]


def layout() -> st.SearchStrategy[str]:
    pair = st.tuples(st.sampled_from(LAYOUT_KEYS), st.sampled_from(LAYOUT_VALUES) | hostile())
    return st.lists(pair, max_size=4).map(lambda kv: ",".join(f"{k}={v}" for k, v in kv)) | hostile()


def options(draw: st.DrawFn, table: dict[str, st.SearchStrategy[Any]], most: int = 4) -> list[str]:
    """Some of the options in `table` (flag -> strategy of its value, or None for a flag without one)."""
    chosen = draw(st.lists(st.sampled_from(sorted(table)), max_size=most, unique=True))
    argv: list[str] = []
    for flag in chosen:
        argv.append(flag)
        if table[flag] is not None:
            argv.append(draw(table[flag]))
    return argv


@st.composite
def inventory_case(draw: st.DrawFn) -> Case:
    inv, files = draw(inventory_files())
    argv = ["inventory", "show", draw(st.sampled_from([inv] * 6 + ["missing.ini", "existing-dir", "fifo",
                                                                     "/dev/zero", ""]) | hostile())]
    if draw(st.booleans()):
        argv.append("--json")
    return Case(argv, files)


@st.composite
def plan_case(draw: st.DrawFn) -> Case:
    inv, files = draw(inventory_files())
    argv = ["plan", "-m", draw(st.sampled_from(MODELS) | hostile())]
    if draw(st.booleans()):
        argv += ["-i", inv]
    else:
        argv += ["--nodes", draw(number()), "--gpus-per-node", draw(st.sampled_from(["8", "1"]) | number()),
                 "--gpu", draw(st.sampled_from(GPUS))]
    argv += options(draw, {"--link": st.sampled_from(LINKS), "--seq": number(), "--gbs": number(),
                           "--layout": layout(), "--top": number(), "--margin": number(), "--explain": None,
                           "--json": None, "-k": number()})
    return Case(argv, files)


@st.composite
def render_case(draw: st.DrawFn) -> Case:
    inv, files = draw(inventory_files())
    argv = ["render", "-i", inv, "-m", draw(st.sampled_from(MODELS)), "--out", draw(st.sampled_from(OUT_PATHS))]
    argv += options(draw, {
        "--layout": layout(), "--stage": st.sampled_from(["warmup", "scale", "soak"]) | hostile(),
        "--run-id": hostile(), "--engine": st.sampled_from(["torch", "megatron"]) | hostile(),
        "--iterations": number(), "--seq": number(), "--gbs": number(), "--nproc-per-node": number(),
        "--pg-timeout": number(), "--save-interval": number(), "--lr": number(),
        "--seed-option": st.sampled_from(["nccl-algo-tree", "ib-timeout-22"]) | hostile(),
        "--env": st.tuples(hostile(), hostile()).map("=".join) | hostile(), "--no-nvls": None,
        "--remote-dir": st.sampled_from(["/var/lib/stepdeploy/runs", "/tmp", "relative"]) | hostile(),
        "--python": hostile(), "--facts-dir": st.sampled_from([".stepdeploy/facts", "missing", "existing-file"]),
        "--data": st.sampled_from(["missing", "existing-file", "existing-dir", "fifo"]) | hostile(),
        "--dry-run": None, "--json": None}, most=5)
    return Case(argv, files)


@st.composite
def report_case(draw: st.DrawFn) -> Case:
    inv, files = draw(inventory_files())
    files["runs/r1/ledger.sqlite"] = draw(ledger_spec(inv))
    argv = ["report", draw(st.sampled_from(["runs/r1"] * 5 + ["runs", "missing", "existing-file", "fifo"]))]
    argv += options(draw, {"--html": st.sampled_from(["report.html", "runs/r1/report.html", *OUT_PATHS]),
                           "--json": None})
    return Case(argv, files)


@st.composite
def rollout_case(draw: st.DrawFn) -> Case:
    inv, files = draw(inventory_files())
    files["runs/r1/ledger.sqlite"] = draw(ledger_spec(inv))
    verb = draw(st.sampled_from(["run"] * 4 + ["resume", "status", "stop", "list"]))
    run_dir = draw(st.sampled_from(["runs/r1"] * 5 + ["runs", "missing", "existing-file", "fifo"]) | hostile())
    if verb == "run":
        argv = ["rollout", "run", "-i", draw(st.sampled_from([inv] * 5 + ["missing.ini"])),
                "-m", draw(st.sampled_from(MODELS))]
        argv += options(draw, {
            "--stages": st.sampled_from(["warmup", "warmup,scale,soak", "soak", "bake"]) | hostile(),
            "--soak-duration": st.sampled_from(["90s", "10m", "0s", "1e9s", "-5m", "5x"]) | hostile(),
            "--warmup-iterations": number(), "--scale-iterations": number(),
            "--layout": layout(), "--min-scaling-efficiency": number(), "--max-step-time": number(),
            "--pg-timeout": number(), "--seq": number(), "--gbs": number(),
            "--run-dir": st.sampled_from(["runs/new", "runs/r1", "existing-file", "runs/" + "x" * 40]) | hostile(),
            "--executor": st.sampled_from(["fabric", "slurm", "ssh"]) | hostile(),
            "--inject": st.sampled_from(["kill:rank=last@10m", "hang:rank=0@20m", "link-down:node=2@30m,for=90s",
                                         "node-loss:node=x@1s"]) | hostile(),
            "--heartbeat-timeout": st.sampled_from(["180s", "0s"]) | hostile(),
            "--monitor-interval": st.sampled_from(["5s", "0s"]) | hostile(),
            "--max-restarts": number(), "--insecure": None,
            "--checkpoint-interval": st.sampled_from(["auto", "AUTO", "0", "x"]) | number(),
            "--mtbf": st.sampled_from(["6h", "0s", "x"]) | hostile(),
            "--data": st.sampled_from(["missing", "existing-file", "existing-dir", "fifo"]) | hostile()}, most=5)
        if not WIDE or draw(st.integers(0, 3)):
            argv.append("--dry-run")  # a real rollout renders and tries its (unreachable) nodes: bench only
    elif verb == "list":
        argv = ["rollout", "list", "--runs", draw(st.sampled_from(["runs", "missing", "existing-file", "fifo"]))]
        argv += options(draw, {"--json": None})
    else:
        argv = ["rollout", verb, run_dir]
        table: dict[str, Any] = {"--insecure": None} if verb != "status" else {"--json": None}
        if verb == "resume":
            table |= {"--min-scaling-efficiency": number(), "--max-step-time": number()}
        argv += options(draw, table)
    return Case(argv, files)


@st.composite
def run_case(draw: st.DrawFn) -> Case:
    inv, files = draw(inventory_files())
    files["run1/manifest.json"] = draw(manifest_spec(inv, draw(st.sampled_from([["n1"], ["n1", "n2"], ["zz"]]))))
    verb = draw(st.sampled_from(["launch", "status", "logs", "stop", "fetch"]))
    argv = ["run", verb, draw(st.sampled_from(["run1"] * 5 + ["missing", "existing-file", "fifo"]) | hostile())]
    table: dict[str, Any] = {"-i": st.sampled_from([inv, "missing.ini"]), "--insecure": None}
    table |= {"launch": {"--dry-run": None, "--follow": None}, "status": {"--json": None},
              "logs": {"--tail": number(), "--follow": None}, "stop": {"--grace": number()},
              "fetch": {"--dest": st.sampled_from(OUT_PATHS)}}[verb]
    argv += options(draw, table)
    return Case(argv, files)


@st.composite
def preflight_case(draw: st.DrawFn) -> Case:
    inv, files = draw(inventory_files())
    local = draw(st.integers(0, 4)) == 0
    argv = ["preflight", *([inv] if not local or draw(st.booleans()) else []), *(["--local"] if local else [])]
    argv += options(draw, {
        "--limit": st.sampled_from(["n1", "n1,n2", "nosuch"]) | hostile(), "--profile": st.sampled_from(
            ["sim-cpu", "seed-2024", "nope"]) | hostile(), "--json": None, "--sizes": st.sampled_from(
            ["4K", "1M,16M", "1T", "9G", "x"]) | hostile(), "--iters": number(), "--timeout": number(),
        "--checkpoint-dir": hostile(), "--min-free-gib": number(), "--python": hostile(), "--insecure": None})
    if "--timeout" not in argv:
        argv += ["--timeout", "5"]
    if local and not WIDE:
        argv.append("--no-bandwidth")  # the local sweep starts torchrun: bench only
    return Case(argv, files)


@st.composite
def provision_case(draw: st.DrawFn) -> Case:
    inv, files = draw(inventory_files())
    argv = ["provision", draw(st.sampled_from([inv] * 4 + ["missing.ini", "fifo"]))]
    argv += options(draw, {"--check": None, "--diff": None, "--tags": hostile(), "--limit": hostile(),
                           "--log-dir": st.sampled_from(OUT_PATHS), "--facts-dir": st.sampled_from(OUT_PATHS),
                           "--json": None, "--insecure": None})
    if not WIDE:  # a well-formed provisioning run starts ansible-playbook: bench only
        argv += ["--log-dir", "existing-file"]
    return Case(argv, files)


@st.composite
def sim_case(draw: st.DrawFn) -> Case:
    verb = draw(st.sampled_from(["up", "down", "status", "ssh", "publish"]))
    argv = ["sim", verb]
    if verb == "up":  # never a node count that would start a cluster
        argv += ["--nodes", draw(st.sampled_from(["0", "-1", "65", "100000", "x", "", "nan", "²"]))]
        argv += options(draw, {"--name": hostile(), "--subnet": st.sampled_from(["8.8.8.0/24", "10.0.0.0/25", "x"])
                               | hostile(), "--json": None})
    elif verb == "ssh":
        argv += [draw(hostile()), *draw(st.lists(hostile(), max_size=2))]
    elif verb == "publish":
        argv += draw(st.lists(st.sampled_from(["existing-file", "fifo", "missing.deb", "existing-dir"]) | hostile(),
                              min_size=1, max_size=2))
    else:
        argv += options(draw, {"--name": st.sampled_from(["fz", "sim"]) | hostile(), "--json": None,
                               **({"--purge": None} if verb == "down" else {})})
    return Case(argv)


@st.composite
def demo_case(draw: st.DrawFn) -> Case:
    bad = draw(st.sampled_from(["--nodes", "--soak-iterations"]))  # never a demo that would start
    argv = ["demo", bad, draw(st.sampled_from(["0", "-1", "65", "x", "", "nan"] if bad == "--nodes"
                                              else ["x", "", "19", "-1", "1e3", "100001"]))]
    argv += options(draw, {"--runs": st.sampled_from(OUT_PATHS), "--keep": None})
    return Case(argv)


@st.composite
def data_case(draw: st.DrawFn) -> Case:
    """`data prepare`: inputs missing, special (a FIFO, /dev/zero), hostile names, text that is not UTF-8; every
    kind of --out."""
    files = {"docs/a.md": ("text", "# a\nsome text\n"), "docs/b.txt": ("bytes", b"\xff\xfe\x00 not utf-8"),
             "empty-dir/.keep": ("text", "")}
    inputs = draw(st.lists(st.sampled_from(["docs", "docs/a.md", "existing-file", "existing-dir", "empty-dir",
                                            "missing", "fifo", "/dev/zero", "/proc/self/mem", ""]) | hostile(),
                           min_size=0, max_size=3))
    argv = ["data", "prepare", *inputs]
    if draw(st.booleans()):
        argv += ["--out", draw(st.sampled_from(OUT_PATHS))]
    argv += options(draw, {"--json": None})
    return Case(argv, files)


# never "up" or "demo": a stray vector must not be able to start a cluster
WORDS = ["provision", "preflight", "render", "report", "plan", "sim", "inventory", "rollout", "run", "show",
         "list", "status", "--help", "-h", "--version", "--json", "--no-such-option", "-x", "--", "-"]


@st.composite
def stray_case(draw: st.DrawFn) -> Case:
    """Argument vectors that are no command at all: unknown words, stray options, help in odd places."""
    first = draw(st.sampled_from(["sim", "inventory", "rollout", "run", "plan", "render", "data"]))
    return Case([first, *draw(st.lists(st.sampled_from(WORDS) | hostile(), max_size=4))])


COMMANDS: dict[str, Callable[[], st.SearchStrategy[Case]]] = {
    "inventory": inventory_case, "plan": plan_case, "render": render_case, "report": report_case,
    "rollout": rollout_case, "run": run_case, "preflight": preflight_case, "provision": provision_case,
    "sim": sim_case, "demo": demo_case, "data": data_case, "stray": stray_case,
}
