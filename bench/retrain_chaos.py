"""Retraining chaos: real retraining jobs killed at random points and re-run, the registry audited after every run.

    python bench/retrain_chaos.py            # five scheduled dates
    python bench/retrain_chaos.py --smoke    # three dates, fewer kills
    python bench/retrain_chaos.py --seed 1 --dir /tmp/rc

A local Ray cluster (``ray start --head --block`` on loopback, stopped by its process id at the end) and, for each
scheduled date in turn, one retraining job: ``entrypoints/retrain.py --config <tiny config> retrain.date=<date>`` in a
subprocess joining that cluster (the tiny UNet on CPU, the digits demo split into ``date=YYYY-MM-DD`` partitions,
``retrain.tolerance=0``: promoted only if better or equal). Every attempt of a date's job has the same
ANYSCALE_PRODJOB_ID, as an Anyscale job's retries do, so a re-run takes over the lock its killed attempt left. The
dates: a first version; a complete partition without data; a model trained with a learning rate that wrecks it (must
not be promoted); then ordinary days.

Each date's job is killed, then re-run until it completes (exit 0):

1. SIGKILL at a random wall-clock moment after the job says what it trains (Ray start, training, a checkpoint,
   the evaluation, the writes; a kill that comes after the job ended counts as no kill);
2. then SDTRAIN_CHAOS_KILL_AFTER_WRITES=N (the registry's hook: the process SIGKILLs itself right after its Nth
   registry write: the lock, the version's directory, its weights, its manifest, the pointer, the log entry, the
   release), N drawn at random from 1-7 for each of three attempts (--smoke: one); an attempt that makes fewer than N
   writes completes, and one more plain run of the done date must change nothing;
3. a plain run, if the date is not done yet.

After every attempt, killed or not, the registry is audited:

- production.json names a complete version (manifest, UNet weights, scheduler), promoted; a move names the
  version it replaced as the new one's parent, and the new one's val_loss is at most the replaced one's (the first
  version excepted); the wrecked date's version is never named;
- the production log is a chain (seq 1..n, each entry's from = the previous one's to), each promote entry names a
  version promoted over its from, no version is named twice, and the last entry names production (a killed attempt
  may leave the pointer one promotion ahead of the log, which the next run records; a completed one may not);
- at most one complete version a date; each version's run trained (its run directory's dataset index: the files it
  read; its final checkpoint at train.max_steps) exactly the manifest's partitions, warm-started from its parent;
  every partition a version records as seen was trained by its run or an ancestor's, or holds no parquet file: no
  partition both seen and untrained;
- after a completed attempt: no retrain.lock, no swap marker left.

It prints each attempt (how it was killed, what it had written, the audit) and RESULT lines. Not a CI test: the
full run takes many minutes. Results: bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from support.ray_head import start_head, stop_head  # noqa: E402  (the suite's own head: one way to start one)

MAX_STEPS = 12
TOLERANCE = 0.0
WRECKED_LR = 5.0  # the learning rate of the date whose model must not be promoted
ATTEMPT_TIMEOUT_S = 600
EPS = 1e-9  # val losses are recorded as computed; equal is allowed


@dataclass
class Day:
    date: str
    files: list[str]  # demo train files in this partition ([] = complete, no data)
    overrides: list[str] = field(default_factory=list)
    expect: tuple[str, ...] = ()  # the statuses its completed attempt may report


@dataclass
class Attempt:
    date: str
    number: int
    kill: str  # "wall-clock" | "writes=N" | "none"
    returncode: int | None = None
    killed: bool = False
    wrote: list[str] = field(default_factory=list)  # what the registry gained (or lost) in this attempt
    status: str = ""
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="three dates, fewer kills")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points (default: %(default)s)")
    parser.add_argument("--dir", help="working directory (default: a new temporary one, removed at the end)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(args.dir or tempfile.mkdtemp(prefix="sdtrain-retrain-chaos-"))
    started = time.time()

    days = make_partitions(root, smoke=args.smoke)
    config = write_config(root)
    head, ray_env, ray_tmp = start_ray()
    attempts: list[Attempt] = []
    state = AuditState()
    try:
        for day in days:
            attempts += run_day(day, config, root, ray_env, rng, state, smoke=args.smoke)
    finally:
        stop_ray(head, ray_tmp)
    wall = time.time() - started

    final = final_checks(root, days, state)
    killed = [a for a in attempts if a.killed]
    recovered_dates = [d.date for d in days if any(a.date == d.date and a.kill == "none" for a in attempts)]
    failed = [a for a in attempts if a.problems]
    audits = len(attempts)
    print()
    print(f"[retrain-chaos] {len(days)} dates, {len(attempts)} attempts, {wall:.0f} s, in {root}")
    for a in attempts:
        mark = "FAILED" if a.problems else "ok"
        print(
            f"  {a.date} #{a.number} kill={a.kill:<12} rc={a.returncode!s:<4} {a.seconds:5.0f} s  "
            f"wrote: {', '.join(a.wrote) or '-':<48} status: {a.status or '-':<20} audit {mark}"
        )
        for problem in a.problems:
            print(f"      PROBLEM: {problem}")
    after = sorted({w for a in killed for w in a.wrote[-1:]})
    print(
        f"RESULT kills = {len(killed)} (wall-clock {sum(a.kill == 'wall-clock' for a in killed)}, "
        f"after a registry write {sum(a.kill.startswith('writes') for a in killed)})"
    )
    print(f"RESULT kills landed after: {', '.join(after) or '-'}")
    print(f"RESULT recoveries = {len(recovered_dates)}/{len(days)} dates completed by a re-run")
    print(f"RESULT audits passed = {audits - len(failed)}/{audits}, failed = {len(failed)}")
    print(f"RESULT final checks: {'passed' if not final else 'FAILED'}")
    for problem in final:
        print(f"  PROBLEM: {problem}")
    print(f"RESULT production: {state.production_history}")
    ok = not failed and not final and len(recovered_dates) == len(days)
    if ok and not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


# --- the data, the config and the cluster -------------------------------------------------------------------


def make_partitions(root: Path, smoke: bool) -> list[Day]:
    sys.path.insert(0, str(REPO / "src"))
    from sdtrain.demo.digits import ensure_demo_data

    demo = root / "demo"
    ensure_demo_data(str(demo / "train"), str(demo / "val"), caption_dim=32)
    parts = sorted(str(p) for p in (demo / "train").glob("*.parquet"))
    days = [
        Day("2026-11-01", parts[:1], expect=("promoted", "completed-promotion", "already-done")),
        Day("2026-11-02", [], expect=("no-new-data",)),  # complete, holding nothing: passed over
        Day("2026-11-03", parts[1:2], [f"train.lr={WRECKED_LR}"], expect=("rejected", "already-done")),
        # v0001 has not seen 11-02 (empty) and 11-03 (its version was rejected): this run takes all three.
        Day("2026-11-04", parts[2:3], expect=("promoted", "completed-promotion", "rejected", "already-done")),
        Day("2026-11-05", parts[3:], expect=("promoted", "completed-promotion", "rejected", "already-done")),
    ]
    if smoke:
        days = days[:3]
    for day in days:
        partition = root / "daily" / f"date={day.date}"
        partition.mkdir(parents=True)
        for f in day.files:
            shutil.copy(f, partition / Path(f).name)
        (partition / "_SUCCESS").touch()
    return days


def write_config(root: Path) -> Path:
    config = root / "retrain-chaos.yaml"
    config.write_text(
        f"""# bench/retrain_chaos.py: the tiny retraining job
data:
  val: {root}/demo/val
model:
  preset: tiny
train:
  max_steps: {MAX_STEPS}
  global_batch_size: 16
  lr: 1.0e-3
  warmup_steps: 2
scaling:
  num_workers: 1
  use_gpu: false
run:
  name: chaos
  storage_path: {root}/runs
  log_every_n_steps: 4
checkpoint:
  every_n_steps: 4
sample_grid:
  steps: 2
export:
  enabled: false
failure:
  max_failures: 0
retrain:
  data_root: {root}/daily
  models_root: {root}/models
  tolerance: {TOLERANCE}
"""
    )
    return config


def start_ray() -> tuple[subprocess.Popen, dict[str, str], str]:
    """A 2-CPU head on loopback: jobs join it (RAY_ADDRESS), so a SIGKILLed job's workers are the cluster's to end."""
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths have a length limit
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    try:
        head, gcs, _ = start_head(bin_dir / "ray", env, temp_dir, timeout_s=120)
    except RuntimeError as e:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise SystemExit(str(e)) from None
    print(f"[retrain-chaos] Ray head pid {head.pid} at 127.0.0.1:{gcs}", flush=True)
    job_env = {**env, "RAY_ADDRESS": f"127.0.0.1:{gcs}", "PYTHONPATH": str(REPO / "src")}
    return head, job_env, temp_dir


def stop_ray(head: subprocess.Popen, temp_dir: str) -> None:
    stop_head(head)
    shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_train_workers_gone(timeout: float = 90) -> None:
    """A killed driver's Ray Train actors are ended by the cluster; the next attempt needs their CPUs."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
        if not any("RayTrainWorker" in n or "TrainController" in n for n in names):
            return
        time.sleep(1)
    print("[retrain-chaos] Ray Train actors of a killed job still alive after 90 s", flush=True)


# --- one date's job, killed and re-run -----------------------------------------------------------------------


def run_day(
    day: Day, config: Path, root: Path, ray_env: dict, rng: random.Random, state: AuditState, smoke: bool
) -> list[Attempt]:
    from sdtrain.artifacts.conditional_writes import CHAOS_KILL_VAR
    from sdtrain.driver.retrain import JOB_ID_VAR

    env = {**ray_env, JOB_ID_VAR: f"prodjob_chaos_{day.date}"}
    command = [sys.executable, str(REPO / "entrypoints" / "retrain.py"), "--config", str(config)]
    command += [f"retrain.date={day.date}", *day.overrides]
    plan: list[str] = ["wall-clock"]
    plan += [f"writes={rng.randint(1, 7)}" for _ in range(1 if smoke else 3)]
    attempts = []
    for number, kill in enumerate([*plan, "none"], start=1):
        attempt = Attempt(day.date, number, kill)
        before = snapshot(root)
        attempt_env = dict(env)
        if kill.startswith("writes="):
            attempt_env[CHAOS_KILL_VAR] = kill.split("=")[1]
        t0 = time.time()
        out = run_attempt(command, attempt_env, kill, rng, root, attempt)
        attempt.seconds = time.time() - t0
        attempt.wrote = diff(before, snapshot(root))
        attempt.status = parse_status(out) if attempt.returncode == 0 else ""
        if attempt.returncode not in (0, -signal.SIGKILL):
            attempt.problems.append(f"exit {attempt.returncode}: {out[-1500:]}")
        if attempt.returncode == 0 and day.expect and attempt.status not in day.expect:
            attempt.problems.append(f"status {attempt.status!r}, expected one of {day.expect}")
        attempt.problems += audit(root, state, completed=attempt.returncode == 0, wrecked=wrecked_dates(root))
        print(
            f"[retrain-chaos] {day.date} attempt {number} kill={kill} rc={attempt.returncode} "
            f"({attempt.seconds:.0f} s) wrote {attempt.wrote or '-'} status {attempt.status or '-'}: "
            f"audit {'FAILED ' + '; '.join(attempt.problems) if attempt.problems else 'passed'}",
            flush=True,
        )
        attempts.append(attempt)
        if attempt.killed:
            wait_for_train_workers_gone()
        if attempt.returncode == 0 and kill == "none":
            break
        if attempt.returncode == 0:
            # Completed although its kill was planned (the job ended first, or made fewer writes than N): the
            # date is done; one more plain run shows a re-run of a done date changes nothing.
            attempt.kill = f"{kill} (missed)"
            continue_plain = Attempt(day.date, number + 1, "none")
            before = snapshot(root)
            t0 = time.time()
            out = run_attempt(command, env, "none", rng, root, continue_plain)
            continue_plain.seconds = time.time() - t0
            continue_plain.wrote = diff(before, snapshot(root))
            continue_plain.status = parse_status(out) if continue_plain.returncode == 0 else ""
            if continue_plain.returncode != 0:
                continue_plain.problems.append(f"exit {continue_plain.returncode}: {out[-1500:]}")
            if continue_plain.status not in ("already-done", "no-new-data", "rolled-back"):
                continue_plain.problems.append(f"a re-run of a done date reported {continue_plain.status!r}")
            if [w for w in continue_plain.wrote if w not in ("lock taken", "lock released")]:
                continue_plain.problems.append(f"a re-run of a done date wrote {continue_plain.wrote}")
            continue_plain.problems += audit(root, state, completed=True, wrecked=wrecked_dates(root))
            print(
                f"[retrain-chaos] {day.date} attempt {number + 1} (re-run of a done date) rc="
                f"{continue_plain.returncode} status {continue_plain.status}: audit "
                f"{'FAILED ' + '; '.join(continue_plain.problems) if continue_plain.problems else 'passed'}",
                flush=True,
            )
            attempts.append(continue_plain)
            break
    return attempts


def run_attempt(command, env, kill: str, rng: random.Random, root: Path, attempt: Attempt) -> str:
    log_path = root / "logs" / f"{attempt.date}-{attempt.number}.log"
    log_path.parent.mkdir(exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ATTEMPT_TIMEOUT_S
        kill_at = None
        while process.poll() is None and time.monotonic() < deadline:
            if kill == "wall-clock" and kill_at is None and "retraining on" in log_path.read_text():
                kill_at = time.monotonic() + rng.uniform(1, 40)  # Ray start, training, evaluation, the writes
            if kill_at is not None and time.monotonic() >= kill_at:
                os.kill(process.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        if process.poll() is None and time.monotonic() >= deadline:
            os.kill(process.pid, signal.SIGKILL)
            attempt.problems.append(f"ran past {ATTEMPT_TIMEOUT_S} s: killed")
        attempt.returncode = process.wait()
    attempt.killed = attempt.returncode == -signal.SIGKILL
    return log_path.read_text()


def parse_status(out: str) -> str:
    for line in out.splitlines():
        if line.startswith("[sdtrain] ") and ": " in line and not line.startswith("[sdtrain] production:"):
            word = line[len("[sdtrain] ") :].split(":", 1)[0]
            if word in {
                "promoted",
                "rejected",
                "already-done",
                "completed-promotion",
                "superseded",
                "rolled-back",
                "no-new-data",
            }:
                return word
    return "?"


# --- what the registry holds, before and after an attempt -----------------------------------------------------


def snapshot(root: Path) -> dict:
    models = root / "models"
    versions = {}
    for d in sorted((models / "versions").glob("v*")):
        versions[d.name] = (d / "manifest.json").exists(), (d / "unet").exists()
    lock = models / "retrain.lock"
    return {
        "lock": lock.read_text() if lock.exists() else None,
        "versions": versions,
        "production": (models / "production.json").read_text() if (models / "production.json").exists() else None,
        "log": len(list((models / "production_log").glob("*.json"))),
    }


def diff(before: dict, after: dict) -> list[str]:
    """What an attempt changed in the registry, in the order a run writes it."""
    changes = []
    if after["lock"] is not None and after["lock"] != before["lock"]:
        changes.append("lock taken")
    for name, (complete, weights) in after["versions"].items():
        was = before["versions"].get(name, (False, False))
        if name not in before["versions"]:
            changes.append(f"{name} claimed")
        if weights and not was[1]:
            changes.append(f"{name} weights")
        if complete and not was[0]:
            changes.append(f"{name} manifest")
    if after["production"] != before["production"]:
        changes.append(f"pointer -> {json.loads(after['production'])['version']}")
    if after["log"] > before["log"]:
        changes.append(f"log +{after['log'] - before['log']}")
    if after["lock"] is None and (before["lock"] is not None or changes):
        changes.append("lock released")
    return changes


# --- the audit ----------------------------------------------------------------------------------------------


@dataclass
class AuditState:
    production: str | None = None
    production_history: list[str] = field(default_factory=list)


def wrecked_dates(root: Path) -> set[str]:
    return {"2026-11-03"}


def empty_partition(root: Path, date: str) -> bool:
    return not list((root / "daily" / f"date={date}").glob("*.parquet"))


def trained_partitions(checkpoint: str) -> tuple[set[str], int | None, list[str]]:
    """(the partitions a version's training run read, its checkpoint's step, problems): from the run directory's
    dataset index (the files the run read) and the checkpoint's data state."""
    from sdtrain.data.index_format import read_index, run_index_uri
    from sdtrain.data.read_order import files_digest
    from sdtrain.storage.run_layout import DATA_STATE_FILE

    run_dir = os.path.dirname(checkpoint.rstrip("/"))
    problems = []
    uri = run_index_uri(run_dir, "data.train")
    index = read_index(uri)
    if index is None:
        return set(), None, [f"{uri}: no readable dataset index of the run"]
    partitions = set()
    for path in index.paths:
        part = [p for p in str(path).split("/") if p.startswith("date=")]
        if not part:
            problems.append(f"{uri}: {path} is in no date partition")
        else:
            partitions.add(part[-1][len("date=") :])
    step = None
    try:
        data_state = json.loads(Path(checkpoint, DATA_STATE_FILE).read_text())
        step = data_state["step"]
        if data_state["plan"]["files_digest"] != files_digest(index.paths):
            problems.append(f"{checkpoint} was trained on other files than {uri} lists")
    except (OSError, ValueError, KeyError) as e:
        problems.append(f"{checkpoint}: no readable {DATA_STATE_FILE} ({e})")
    return partitions, step, problems


def audit(root: Path, state: AuditState, completed: bool, wrecked: set[str]) -> list[str]:
    from sdtrain.artifacts.registry import ModelRegistry

    models = root / "models"
    registry = ModelRegistry(str(models))
    problems: list[str] = []
    versions = registry.versions()
    manifests = {v: registry.manifest(v) for v in versions}

    # production names a complete, promoted version, better-or-equal than the one it replaced
    production = registry.production()
    if production is not None:
        d = models / "versions" / production
        missing = [
            f
            for f in ("manifest.json", "unet/config.json", "unet/diffusion_pytorch_model.safetensors")
            if not (d / f).exists()
        ]
        if not list((d / "scheduler").glob("*.json")):
            missing.append("scheduler/")
        if missing:
            problems.append(f"production names {production}, which lacks {', '.join(missing)}")
        manifest = manifests.get(production, {})
        if manifest and not manifest.get("promoted"):
            problems.append(f"production names {production}, which was not decided for promotion")
        if manifest.get("schedule_date") in wrecked:
            problems.append(f"production names {production}, the wrecked date's model")
    if production != state.production:
        new = manifests.get(production or "", {})
        if new.get("parent") != state.production:
            problems.append(f"production moved {state.production} -> {production}, whose parent is {new.get('parent')}")
        if state.production is not None:
            old_loss = manifests.get(state.production, {}).get("metrics", {}).get("val_loss")
            new_loss = new.get("metrics", {}).get("val_loss")
            measured = new.get("metrics", {}).get("production_val_loss")
            if new_loss is None or old_loss is None or new_loss > old_loss * (1 + TOLERANCE) + EPS:
                problems.append(f"production moved to {production} at val_loss {new_loss}, worse than {old_loss}")
            if measured is None or new_loss is None or new_loss > measured * (1 + TOLERANCE) + EPS:
                problems.append(f"{production} at {new_loss} promoted over {state.production} measured at {measured}")
        state.production = production
        state.production_history.append(production or "none")

    # the log: a chain that ends at production (or one promotion behind, after a kill)
    log = registry.pointer_log()
    previous = None
    for i, entry in enumerate(log, start=1):
        if entry["seq"] != i or entry["from"] != previous:
            problems.append(f"log entry {i}: seq {entry['seq']} from {entry['from']}, after one to {previous}")
        if entry["kind"] == "promote":
            m = manifests.get(entry["to"], {})
            if not m.get("promoted") or m.get("parent") != entry["from"]:
                problems.append(f"log entry {i} promotes {entry['to']} over {entry['from']}; its manifest disagrees")
        previous = entry["to"]
    named = [e["to"] for e in log]
    if len(named) != len(set(named)):
        problems.append(f"the log names a version twice: {named}")
    last = log[-1]["to"] if log else None
    if last != production:
        pending = (
            production is not None
            and manifests.get(production, {}).get("promoted")
            and manifests[production].get("parent") == last
        )
        if completed or not pending:
            problems.append(f"production is {production} and the log's last entry names {last}")

    # what each version trained and saw
    by_date: dict[str, list[str]] = {}
    trained: dict[str, set[str]] = {}
    for v, m in manifests.items():
        by_date.setdefault(m["schedule_date"], []).append(v)
        partitions, step, found = trained_partitions(m["checkpoint"])
        problems += [f"{v}: {p}" for p in found]
        trained[v] = partitions
        if partitions != set(m["partitions"]):
            problems.append(f"{v}'s run read partitions {sorted(partitions)}; its manifest says {m['partitions']}")
        if step != MAX_STEPS or m["steps"] != MAX_STEPS:
            problems.append(f"{v}'s checkpoint is at step {step} (manifest: {m['steps']}), not {MAX_STEPS}")
        pretrained = m["config"]["model"].get("pretrained")
        if m["parent"] is not None and pretrained != registry.location(m["parent"]):
            problems.append(f"{v} was warm-started from {pretrained}, not its parent {m['parent']}")
    for date, vs in by_date.items():
        if len(vs) > 1:
            problems.append(f"{date} has {len(vs)} complete versions: {vs}")
    for v, m in manifests.items():
        lineage, chain = set(), v
        while chain is not None:
            lineage |= trained.get(chain, set())
            chain = manifests.get(chain, {}).get("parent")
        untrained = [p for p in m["partitions_seen"] if p not in lineage and not empty_partition(root, p)]
        if untrained:
            problems.append(f"{v} records {untrained} as seen; neither its run nor its ancestors' trained them")
        parent_seen = manifests[m["parent"]]["partitions_seen"] if m["parent"] in manifests else []
        if not set(parent_seen) <= set(m["partitions_seen"]):
            problems.append(
                f"{v} forgot partitions its parent had seen: {sorted(set(parent_seen) - set(m['partitions_seen']))}"
            )

    if completed:
        if (models / "retrain.lock").exists():
            problems.append("retrain.lock left by a completed run")
        markers = [str(p.relative_to(models)) for p in models.rglob("*.swap-*")]
        if markers:
            problems.append(f"swap markers left: {markers}")
    return problems


def final_checks(root: Path, days: list[Day], state: AuditState) -> list[str]:
    """What the whole schedule should have left: every date done, every non-empty partition in production's lineage
    trained or its version rejected, the wrecked model never served."""
    from sdtrain.artifacts.registry import ModelRegistry

    registry = ModelRegistry(str(root / "models"))
    problems = []
    production = registry.production()
    if production is None:
        return ["production names nothing at the end"]
    manifests = {v: registry.manifest(v) for v in registry.versions()}
    newest = manifests[max(manifests)]
    if set(newest["partitions_seen"]) != {d.date for d in days}:
        problems.append(f"the newest version has seen {newest['partitions_seen']}, not every date")
    for v, m in manifests.items():
        if m["schedule_date"] in wrecked_dates(root) and (m["promoted"] or v in registry.served()):
            problems.append(f"{v}, the wrecked date's model, was promoted")
    if any(m["schedule_date"] == "2026-11-02" for m in manifests.values()):
        problems.append("the empty date got a version of its own")
    log = registry.pointer_log()
    if not log or log[-1]["to"] != production:
        problems.append("the log does not end at production")
    return problems


if __name__ == "__main__":
    sys.exit(main())
