"""`python -m engine run` as other tools call it: exit codes, JSON keys, the trace file, torchrun."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, says", [
    (["--world", "0"], "world=0"),
    (["--world", "65"], "world=65"),
    (["--mesh", "fsdp=2", "--zero-stage", "0"], "drop --zero-stage 0 or name the axis dp"),
    (["--mesh", "dp=2,zz=2", "--world", "4"], "mesh axis 'zz' is unknown"),
    (["--mesh", "dp=3", "--world", "4"], "has 3 ranks but world=4"),
    (["--steps", "0"], "steps=0"),
])
def test_bad_input_exits_2_with_a_message(args, says):
    out = _engine("run", *args)
    assert out.returncode == 2, out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("args, says", [
    (["--seq-len", "1"], "seq_len=1: attention over a single token"),
    (["--mesh", "dp=\u00b2"], "must look like name=degree"),  # "²" is a digit to str.isdigit, not to int()
    # the step's batch is seeded with seed x 1,000,003 + step (engine.config.data_seed), which torch takes below 2**64
    (["--seed", str((2**64 - 3) // 1_000_003 + 1)], "must be between 0 and 18,446,688,733,643"),
    (["--strategy", "ep", "--capacity-factor", "inf"], "capacity_factor=inf must be a positive number"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "3"], "this mesh has no pp axis"),
    (["--schedule", "gpipe"], "--schedule gpipe orders pipeline stages, and this mesh has no pp axis"),
    # flags this run would not use had been ignored without a word (engine.cli.unused_flag)
    (["--cp-variant", "allgather"], "this mesh has no cp axis: add one (e.g. --mesh cp=2) or drop --cp-variant"),
    (["--ssm-cp", "alltoall"], "no Mamba-2 layer: use --arch mamba2 or hybrid, or drop --ssm-cp"),
    (["--arch", "mamba2", "--ssm-cp", "alltoall"], "no cp axis: add one (e.g. --mesh cp=2), or drop --ssm-cp"),
    (["--no-prefetch"], "this run keeps whole weights (ZeRO stage 0)"),
    (["--strategy", "fsdp", "--dp-comm", "naive"], "this run is ZeRO stage 3: use --strategy dp, or drop --dp-comm"),
    (["--strategy", "tp", "--dp-comm", "naive"], "(no dp, fsdp, ep or cp axis)"),
    (["--experts", "8"], "this model's MLP is dense: add --mlp moe or drop --experts"),
    (["--top-k", "3"], "this model's MLP is dense: add --mlp moe or drop --top-k"),
    (["--ssm-chunk", "4"], "this model is a Transformer: use --arch mamba2 or hybrid, or drop --ssm-chunk"),
    # had first said "set --virtual-stages 1 or use --schedule interleaved-1f1b", which then said "no pp axis"
    (["--virtual-stages", "2"], "this mesh has no pp axis: add one (e.g. --mesh pp=2) or drop --virtual-stages"),
    (["--vocab", "1000000", "--hidden", "4096"], "this run needs at least 123.6 GiB"),
    (["--trace", "/"], "--trace /: it is a folder"),
    (["--trace", "/no/such/folder/t.json"], "its folder /no/such/folder does not exist"),
    (["--world", "abc"], "argument --world: invalid int value: 'abc' (see: python -m engine run -h)"),
    # sizes past anything this machine or a GPU holds are refused before anything is built from them (10^12
    # layers had spelled out 10^12 layer kinds; 10^9 micro-batches had drawn a terabyte of token ids per rank)
    (["--layers", "1000000000000"], "model layers=1,000,000,000,000 is more than the engine runs (at most 4,096)"),
    (["--mesh", "pp=2", "--schedule", "interleaved-1f1b", "--virtual-stages", "1000000000000"],
     "use a smaller --virtual-stages"),
    (["--heads", "1000000000", "--hidden", "2000000000"], "choose a smaller hidden (--hidden)"),
    (["--micro-batches", "1000000000"], "use at most 4,096 for --micro-batches"),
    # the way back points the right way (0 had been told "use fewer")
    (["--micro-batches", "0"], "use 1 or more for --micro-batches"),
    (["--mesh", "pp=2", "--virtual-stages", "0"], "use 1 or more for --virtual-stages"),
    # a count of something this model does not use is still a count (--experts -4 had run a dense model)
    (["--experts", "-4"], "model experts=-4 must be at least 1 (--experts)"),
    (["--arch", "hybrid", "--pattern", "MMA", "--mesh", "pp=2"], "give --pattern a multiple of 2 letters"),
    # os.access says yes to root everywhere: the path is opened as the write will open it, before the run
    (["--trace", "/proc/shardlab-trace.json"], "a file cannot be written there"),
    (["--strategy", "ep", "--capacity-factor", "1e20"], "up to 1,000 (from experts / top_k = 2 up"),
    (["--capacity-factor", "nan"], "this model has no experts: drop --capacity-factor"),
    (["--timeout-s", "nan"], "timeout_s=nan must be a positive, finite number of seconds (--timeout-s)"),
    # inf had run without a limit and printed "timeout_s": Infinity, which is not JSON
    (["--timeout-s", "inf"], "timeout_s=inf must be a positive, finite number of seconds (--timeout-s)"),
    # 10^23 steps had blamed the seed: "seed=0 must be between 0 and -99,981,253,312,166,354"
    (["--steps", "1" + "0" * 23], "must be between 1 and 1,000,000 (--steps)"),
    (["--arch", "hybrid", "--layers", "3", "--pattern", "MAX"], "pattern='MAX' has 'X'"),
    (["--arch", "hybrid", "--layers", "3", "--pattern", "MAX"], "e.g. MAM"),
    (["--mesh", ""], "--mesh '' names no axis"),  # had been taken for no --mesh at all
    (["--trace", "/no/such/folder/"], "it ends in '/', so it names a folder"),
])
def test_refused_before_any_worker_starts_with_json_too(args, says, capsys, monkeypatch):
    """Each is refused with exit 2 and a message before a rank starts (a model too big for this machine before
    any allocates it; a trace path that cannot be written before the run, not after); under --json the
    message is also the one JSON object on stdout."""
    from engine import cli, config

    monkeypatch.setattr(config, "machine_memory_bytes", lambda: 24 * 2**30)
    args = [a.encode().decode("unicode_escape") for a in args]
    assert cli.main(["run", *args]) == 2
    out = capsys.readouterr()
    assert says in out.err and out.out == ""
    assert cli.main(["run", *args, "--json"]) == 2
    assert json.loads(capsys.readouterr().out) == {"ok": False, "error": out.err.removeprefix("error: ").strip()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", ["--strategy fsdp", "--strategy tp", "--strategy dp --dp-comm naive",
                                   # activations large beside the weights: their floor must stay a floor
                                   "--micro-batch-size 32 --seq-len 128 --vocab 256",
                                   "--hidden 256 --ffn 1024 --heads 8 --kv-heads 2 --micro-batch-size 16",
                                   "--strategy ep --micro-batch-size 32 --seq-len 128 --vocab 256",
                                   "--strategy cp --micro-batch-size 16 --seq-len 128 --vocab 256",
                                   "--arch mamba2 --strategy cp --micro-batch-size 16 --seq-len 128 --vocab 256",
                                   "--mesh pp=2 --micro-batches 2 --micro-batch-size 16 --seq-len 128 --vocab 256"])
def test_the_memory_a_run_is_refused_by_is_at_most_what_it_holds(flags, pools):
    """engine.config.least_memory_bytes is a floor: the engine's own count of what its ranks hold (weights,
    gradients, Adam state, gathered weights, the activations' peak, logits among them) never comes under it,
    with a vocabulary large enough that the logits count, or a batch large enough that the activations do.
    On the folder's warm 2-rank pool (tests/engine/conftest.py): a pool started for each case cost 3 s of 3.5."""
    from engine.cli import config_from_args, run_parser
    from engine.config import least_memory_bytes
    from engine.run import run

    extra = [] if "--vocab" in flags else ["--vocab", "4096"]
    cfg = config_from_args(run_parser("x").parse_args(flags.split() + ["--world", "2", "--steps", "2", *extra]))
    summary, _ = run(cfg, traced=False, pool=pools(2))
    assert least_memory_bytes(cfg) <= sum(rank["total"] for rank in summary.memory_bytes)


@pytest.mark.parametrize("flags, mlp", [
    ("--strategy ep", "moe"), ("--mesh ep=2,cp=2 --world 4", "moe"), ("--mesh ep=2,dp=2 --world 4", "moe"),
    ("--mesh dp=2,cp=2 --world 4", "dense"), ("--mesh dp=2 --world 2 --mlp moe", "moe"),
])
def test_the_mlp_is_moe_wherever_the_experts_are_split(flags, mlp):
    """--mesh ep=2,cp=2 picks strategy cp, and had got a dense MLP, which ep then refused ("use --mlp moe")
    against the help's "moe for ep"."""
    from engine.cli import argv_for, config_from_args, run_parser

    cfg = config_from_args(run_parser("x").parse_args(flags.split()))
    assert cfg.model.mlp == mlp
    assert config_from_args(run_parser("x").parse_args(argv_for(cfg))) == cfg


def test_an_abbreviated_json_flag_still_gets_the_json_object(capsys):
    """argparse takes --js for --json; a bad flag beside it is answered in JSON too."""
    from engine import cli

    assert cli.main(["run", "--js", "--world", "x"]) == 2
    assert json.loads(capsys.readouterr().out)["ok"] is False
    assert cli.main(["run", "--json=1", "--world", "2"]) == 2  # refused, yet JSON was asked for
    assert "--json" in json.loads(capsys.readouterr().out)["error"]


def test_unknown_choice_exits_2():
    out = _engine("run", "--strategy", "zz")
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.multiprocess
def test_done_when_command(tmp_path):
    trace = tmp_path / "t.json"
    out = _engine("run", "--strategy", "fsdp", "--zero-stage", "3", "--world", "4", "--steps", "3", "--check",
                  "--trace", str(trace), "--json")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert reply["ok"] and reply["check"]["passed"] and reply["world"] == 4
    assert reply["check"]["max_abs_diff"] < 1e-4
    assert reply["step_time_s"] > 0
    assert len(reply["memory_bytes"]) == 4 and len(reply["comm_bytes"]) == 4
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}


@pytest.mark.multiprocess
def test_run_past_its_time_limit_exits_3():
    out = _engine("run", "--strategy", "dp", "--world", "2", "--steps", "50", "--timeout-s", "0.2", "--json")
    assert out.returncode == 3, out.stderr
    assert "timed out" in out.stderr and json.loads(out.stdout)["ok"] is False


@pytest.mark.multiprocess
def test_same_worker_entry_under_torchrun_with_two_nodes(tmp_path):
    # Two torchrun "nodes" on 127.0.0.1, one rank each: the multi-machine path, on one machine.
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port, result = free_port(), tmp_path / "result.json"
    worker = ["-m", "engine.worker", "--strategy", "fsdp", "--steps", "2", "--check", "--out", str(result)]
    nodes = [subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                               "--master-addr", "127.0.0.1", "--master-port", str(port), *worker],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
             for node in (0, 1)]
    try:
        logs = [n.communicate(timeout=120)[0] for n in nodes]
    finally:
        for n in nodes:  # torchrun and its rank processes, whatever happened
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait()
    assert [n.returncode for n in nodes] == [0, 0], logs
    reply = json.loads(result.read_text())
    assert reply["ok"] and reply["check"]["passed"] and reply["world"] == 2
    # the same keys as --json: a prediction that says why it has no step time (the ranks may be anywhere)
    assert reply["predicted"]["step_time_s"] is None and "torchrun" in reply["predicted"]["why"]


def test_torchrun_refuses_an_out_path_it_cannot_write_before_the_run(tmp_path, monkeypatch, capsys):
    from engine import worker

    # the run's result had been written after the whole run, into a folder that was not there: a traceback
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code = worker.torchrun_main(["--steps", "1", "--out", str(tmp_path / "missing" / "result.json")])
    assert code == 2 and "--out" in capsys.readouterr().err


def test_json_has_no_nan_or_infinity_tokens():
    from core.timeline import strict_json

    # a diverged run's loss is null, as strict JSON readers need
    assert json.loads(strict_json({"loss": [1.0, float("nan")], "x": float("inf")})) == {"loss": [1.0, None],
                                                                                         "x": None}


@pytest.mark.parametrize("flags", [
    [], ["--strategy", "fsdp", "--world", "4", "--no-prefetch"], ["--strategy", "dp", "--zero-stage", "2"],
    ["--strategy", "tp", "--sequence-parallel", "--heads", "8", "--kv-heads", "4", "--world", "4"],
    ["--strategy", "pp", "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--micro-batches", "4"],
    ["--strategy", "cp", "--cp-variant", "allgather", "--mesh", "dp=2,cp=2", "--world", "4"],
    ["--strategy", "ep", "--capacity-factor", "1.25", "--top-k", "1", "--seed", "3", "--steps", "5"],
    ["--mesh", "cp=2", "--world", "2", "--hidden", "96", "--vocab", "300", "--heads", "6", "--kv-heads", "3"],
    ["--arch", "mamba2", "--strategy", "cp", "--ssm-cp", "alltoall", "--world", "4", "--ssm-chunk", "4"],
    ["--arch", "hybrid", "--pattern", "MMAM", "--mesh", "pp=2", "--ssm-state", "8", "--ssm-groups", "2"],
    ["--arch", "mamba2", "--strategy", "tp", "--ssm-head-dim", "32", "--ssm-groups", "2", "--layers", "3"],
    # seven digits: ':g' had written 1.23457e+06 and 1.23457
    ["--timeout-s", "1234567", "--strategy", "ep", "--capacity-factor", "1.2345678"],
])
def test_argv_for_builds_the_same_config_again(flags):
    from engine.cli import argv_for, command_line, config_from_args, run_parser

    cfg = config_from_args(run_parser("x").parse_args(flags))
    assert config_from_args(run_parser("x").parse_args(argv_for(cfg))) == cfg
    assert command_line(cfg).startswith(".venv/bin/python -m engine run --strategy ")


def test_a_mesh_without_a_strategy_runs_what_it_needs():
    from engine.cli import config_from_args, run_parser

    def strategy(*flags):
        return config_from_args(run_parser("x").parse_args(list(flags))).parallel.strategy

    assert strategy("--mesh", "cp=2", "--world", "2") == "cp"
    assert strategy("--mesh", "ep=2", "--world", "2") == "ep"
    assert strategy("--mesh", "fsdp=2", "--world", "2") == "fsdp"
    assert strategy("--mesh", "pp=2,dp=2,tp=2", "--world", "8") == "dp"
    assert strategy() == "dp"


def test_help_and_unknown_commands():
    from engine import cli

    assert cli.main(["--help"]) == 0 and cli.main(["-h"]) == 0
    assert cli.main(["sweep"]) == 2


def test_unknown_command_is_named(capsys):
    from engine import cli

    assert cli.main(["calibrate"]) == 2
    assert "unknown command 'calibrate'" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_an_unwritable_stdout_is_said_not_a_traceback():
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "engine", "run", "--world", "0", "--json"], cwd=ROOT,
                             stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert "Traceback" not in out.stderr and out.returncode == 2
    assert "cannot write the result to standard output" in out.stderr  # the refusal's JSON could not be written


@pytest.mark.multiprocess
def test_sigterm_ends_the_run_like_an_interrupt(tmp_path):
    """A TERM (a scheduler's, `kill`'s) is cleaned up after as Ctrl-C is: the workers stopped, their log folder
    removed, one JSON object on stdout; the exit status is the shell's 128 + 15."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "engine", "run", "--world", "2", "--steps", "100000", "--json"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("shardlab-pool-*")) and time.monotonic() < deadline:  # the workers are up
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert json.loads(out) == {"ok": False, "error": "terminated"}
    assert not list(tmp_path.glob("shardlab-pool-*"))


def test_a_failed_check_exits_1_even_when_its_trace_cannot_be_written(tmp_path, monkeypatch, capsys):
    # a reviewer's case: the trace's folder went during the run, and the failed check exited 2 (bad input)
    import errno

    import engine.run
    from core.timeline import Timeline
    from engine.cli import EXIT_CHECK_FAILED, main
    from engine.run import RunSummary

    failed = RunSummary(ok=False, check={"passed": False, "exact": False, "max_abs_diff": 0.01, "steps": 1,
                                         "failures": ["step 0 w: grads differs by 0.01"]},
                        world=2, strategy="dp", zero_stage=0, mesh={"dp": 2}, steps=1, micro_batches=1,
                        device="cpu", loss=[5.0], step_time_s=0.01, step_times_s=[0.01], memory_bytes=[{}, {}],
                        comm_bytes=[0, 0], stats={}, config={})

    def unwritable(self, path):
        raise OSError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(engine.run, "run", lambda *a, **k: (failed, Timeline([])))
    monkeypatch.setattr(Timeline, "write_chrome_trace", unwritable)
    code = main(["run", "--world", "2", "--steps", "1", "--check", "--trace", str(tmp_path / "t.json")])
    out = capsys.readouterr()
    assert code == EXIT_CHECK_FAILED and "FAILED" in out.out and "cannot write the trace" in out.err


def test_the_summary_names_the_mesh_and_where_zero_shards():
    # a tp=2 run had printed "dp zero-0 on 2 ranks", and ZeRO-1 on it said nothing of sharding nothing
    from engine.cli import _human
    from engine.run import RunSummary

    def first_lines(mesh, zero_stage, world):
        summary = RunSummary(ok=True, check=None, world=world, strategy="dp", zero_stage=zero_stage, mesh=mesh,
                             steps=1, micro_batches=1, device="cpu", loss=[5.0], step_time_s=0.01,
                             step_times_s=[0.01], memory_bytes=[{}] * world, comm_bytes=[0] * world, stats={},
                             config={})
        return _human(summary).splitlines()[:2]

    assert first_lines({"tp": 2}, 0, 2) == ["2 ranks (cpu), mesh tp=2 (rank order outermost first), 1 steps x 1 "
                                            "micro-batches", "loss per step: 5.00000"]
    assert first_lines({"tp": 2}, 1, 2)[1] == ("ZeRO-1 shards over dp, which this mesh does not split: nothing is "
                                               "sharded (add dp=2 to --mesh to shard)")
    assert first_lines({"dp": 2, "fsdp": 2}, 3, 4)[1] == "ZeRO-3 shards over fsdp"
    assert first_lines({"dp": 1}, 1, 1)[1] == "ZeRO-1 shards over dp"
    assert first_lines({"dp": 2, "fsdp": 1}, 1, 2)[1] == "ZeRO-1 shards over dp"  # core.mesh: fsdp of degree 1 is none


def test_a_prediction_checked_on_a_busy_machine_says_so():
    from engine.cli import _human
    from engine.run import RunSummary
    from hardware.this_machine import busy_words

    def lines(speed):
        summary = RunSummary(ok=True, check=None, world=2, strategy="dp", zero_stage=0, mesh={"dp": 2}, steps=1,
                             micro_batches=1, device="cpu", loss=[5.0], step_time_s=0.01, step_times_s=[0.01],
                             memory_bytes=[{}] * 2, comm_bytes=[0] * 2, stats={}, config={},
                             predicted={"step_time_s": 0.012, "breakdown_s": {"compute": 0.012},
                                        "speed_factor": speed})
        return _human(summary).splitlines()

    assert not any(line.startswith("warning:") for line in lines(1.8))  # quiet-machine drift: said, not warned
    busy = [line for line in lines(6.0) if line.startswith("warning:")]
    assert busy == [f"warning: {busy_words(6.0)}"] and "6.0x slower" in busy[0]


def test_the_predictions_notes_are_printed_under_it():
    from engine.cli import _human
    from engine.run import RunSummary

    note = "its attention runs over 512 tokens, longer than the 256 this machine's calibration timed"
    summary = RunSummary(ok=True, check=None, world=2, strategy="dp", zero_stage=0, mesh={"dp": 2}, steps=2,
                         micro_batches=1, device="cpu", loss=[5.0, 4.9], step_time_s=0.01, step_times_s=[0.02, 0.01],
                         memory_bytes=[{}] * 2, comm_bytes=[0] * 2, stats={}, config={},
                         predicted={"step_time_s": 0.012, "breakdown_s": {"compute": 0.012}, "notes": [note]})
    lines = _human(summary).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("predicted"))
    assert lines[at + 1] == f"note on the prediction: {note}"


def test_a_page_s_command_line_is_one_the_command_line_takes():
    """The data-parallel lesson's naive DDP on one process: its --dp-comm naive, which nothing uses there, is left
    out of the command the page shows, which unused_flag would refuse."""
    from engine.cli import argv_for, config_from_args, run_parser
    from engine.config import ParallelConfig, RunConfig

    for world in (1, 2):
        cfg = RunConfig(world=world, parallel=ParallelConfig(strategy="dp", zero_stage=0, dp_comm="naive"))
        again = config_from_args(run_parser("x").parse_args(argv_for(cfg)))
        assert again.parallel.dp_comm == ("naive" if world == 2 else "bucketed")
