"""labkit.launch without starting workers: validation before anything starts, the msrun command, helpers."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from labkit.launch import launcher as launch
from labkit.launch import supervisor
from labkit.launch import validate
from labkit.config import load_run_config
from labkit.errors import LabkitError
from labkit.paths import ROOT


@pytest.fixture
def no_start(monkeypatch):
    """Fail the test if anything tries to start a process. One exception: MindSpore runs `lscpu` when it is first
    imported, which a launch does when it builds the dataset on first use (a fresh checkout): that probe is not a
    start by the launch."""
    real = subprocess.Popen

    def refuse(*args, **kwargs):
        cmd = args[0] if args else kwargs.get("args")
        if Path(str(cmd[0] if isinstance(cmd, (list, tuple)) else cmd).split()[0]).name == "lscpu":
            return real(*args, **kwargs)
        raise AssertionError(f"a process was started: {cmd}")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)


def refused(tmp_path, what: str, **kwargs) -> LabkitError:
    kwargs.setdefault("output", tmp_path / "run")
    with pytest.raises(LabkitError) as e:
        launch.launch(launch.LaunchSpec(**kwargs), progress=False)
    assert what in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists(), "nothing may be written when validation fails"
    return e.value


def test_global_batch_mismatch_fails_before_any_worker_starts(tmp_path, no_start):
    e = refused(tmp_path, "global_batch = 8", config="configs/dp2_cpu.yaml", workers=2, micro_batch=8)
    assert "micro_batch 8 x dp 2 x accum 1 = 16" in e.what


def test_busy_explicit_port_fails_before_any_worker_starts(tmp_path, no_start):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen(1)
        port = s.getsockname()[1]
        e = refused(tmp_path, f"master port {port} is already in use", config="configs/dp2_cpu.yaml",
                    master_port=port)
    assert "--master-port" in e.fix


def test_missing_dataset_fails_before_any_worker_starts(tmp_path, no_start):
    missing = tmp_path / "no_such_dataset"
    e = refused(tmp_path, "no_such_dataset", config="configs/dp2_cpu.yaml",
                overrides=[f"data.dataset={missing}"])
    assert "labkit data build" in e.fix


@pytest.mark.parametrize("kwargs, what", [
    (dict(config="configs/dp2_cpu.yaml", workers=1), "needs at least 2 workers"),
    (dict(config="configs/tiny_cpu.yaml", workers=2, overrides=["parallel.parallel_mode=stand_alone"]),
     "stand_alone but 2 workers"),
    (dict(config="configs/dp2_cpu.yaml", overrides=["parallel.parallel_mode=semi_auto_parallel"]),
     "needs Ascend or GPU"),
    (dict(config="configs/dp2_cpu.yaml", overrides=["parallel.dp=4"]), "parallel.dp = 4 but 2 workers"),
    (dict(config="configs/dp2_cpu.yaml", resume=True), "no complete checkpoint"),
    (dict(config="configs/dp2_cpu.yaml", nodes=2), "--master-addr"),
    (dict(config="configs/dp2_cpu.yaml", nodes=2, master_addr="10.0.0.1"), "explicit --master-port"),
    (dict(config="configs/dp2_cpu.yaml", nodes=2, node_rank=2, master_addr="h", master_port=29500), "outside 0..1"),
    (dict(config="configs/dp2_cpu.yaml", master_port=80), "outside 1024..65535"),
    (dict(config="configs/dp2_cpu.yaml", nodes=2, master_addr="127.0.0.1", master_port=29500),
     "is a loopback address and --nodes > 1: msrun decides it is the master"),
    (dict(config="configs/dp2_cpu.yaml", nodes=2, master_addr="localhost", master_port=29500), "loopback"),
    (dict(config="configs/dp2_cpu.yaml", nodes=2, master_addr="no-such-host.invalid", master_port=29500),
     "does not resolve"),
    (dict(config="configs/dp2_cpu.yaml", overrides=["parallel.cluster_timeout_s=0"]), "cluster_timeout_s must be > 0"),
    (dict(config="configs/dp2_cpu.yaml", overrides=["trian.steps=3"]), "unknown key 'trian'"),
    (dict(config="configs/dp2_cpu.yaml", overrides=["train.init_checkpoint=no/such.ckpt"]), "no/such.ckpt not found"),
])
def test_bad_launches_are_refused_before_start(tmp_path, no_start, kwargs, what):
    refused(tmp_path, what, **kwargs)


def test_an_old_run_is_not_silently_mixed_in(tmp_path, no_start):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(LabkitError, match="already holds a run") as e:
        validate.prepare(validate.LaunchSpec("configs/dp2_cpu.yaml", 2, output=out))
    assert "--resume" in e.value.fix and "--overwrite" in e.value.fix
    again = validate.prepare(validate.LaunchSpec("configs/dp2_cpu.yaml", 2, output=out, overwrite=True))
    assert again.output == str(out.resolve())


def test_more_than_one_worker_means_data_parallel(tmp_path):
    pl = validate.prepare(validate.LaunchSpec("configs/tiny_cpu.yaml", 2, output=tmp_path / "r", micro_batch=4))
    assert (pl.mode, pl.dp, pl.global_batch, pl.total) == ("data_parallel", 2, 8, 2)
    assert pl.cfg.parallel.parallel_mode == "data_parallel"
    assert Path(pl.dataset).is_absolute() and (Path(pl.dataset) / "stats.json").is_file()
    assert validate.port_is_free(pl.master_port)
    one = validate.prepare(validate.LaunchSpec("configs/tiny_cpu.yaml", 1, output=tmp_path / "r"))
    assert (one.mode, one.dp, one.global_batch, one.master_port) == ("stand_alone", 1, 8, None)


def test_command_single_node_and_multi_node(tmp_path):
    pl = validate.prepare(validate.LaunchSpec("configs/dp2_cpu.yaml", 2, output=tmp_path / "r", master_port=29517))
    cmd = validate.command(pl, Path("L.yaml"), Path("logs"))
    assert Path(cmd[0]).name == "msrun" or cmd[1:3] == ["-m", "mindspore.parallel.cluster.run"]
    for flag in ("--worker_num=2", "--local_worker_num=2", "--master_port=29517", "--log_dir=logs", "--join=True"):
        assert flag in cmd
    assert cmd[-7:] == ["python", "-m", "labkit.launch", "train", "--config", "L.yaml", "--json"]
    assert not any(c.startswith("--node_rank") for c in cmd)

    multi = validate.prepare(validate.LaunchSpec("configs/dp2_cpu.yaml", 4, output=tmp_path / "m", nodes=2,
                                                 node_rank=1, master_addr="10.1.2.3", master_port=29500,
                                                 overrides=["train.global_batch=32"]))
    cmd = validate.command(multi, Path("L.yaml"), Path("logs"))
    for flag in ("--worker_num=8", "--local_worker_num=4", "--master_addr=10.1.2.3", "--node_rank=1",
                 "--master_port=29500"):
        assert flag in cmd
    assert (multi.dp, multi.global_batch) == (8, 32)

    single = validate.prepare(validate.LaunchSpec("configs/tiny_cpu.yaml", 1, output=tmp_path / "s", resume=False))
    assert validate.command(single, Path("L.yaml"), Path("logs"))[:4] == ["python", "-m", "labkit.launch", "train"]


def test_loopback_master_with_several_nodes_is_refused_with_the_reason(tmp_path, no_start):
    e = refused(tmp_path, "loopback", config="configs/dp2_cpu.yaml", nodes=2, master_addr="127.0.0.1",
                master_port=29500)
    assert "every node would start a scheduler" in e.what and "network namespace" in e.fix
    mine = sorted(a for a in validate.local_addresses() if "." in a and not a.startswith("127."))
    if mine:  # node 1 given this machine's own address: it would start a second scheduler
        e = refused(tmp_path, "not node 0", config="configs/dp2_cpu.yaml", nodes=2, node_rank=1, master_addr=mine[0],
                    master_port=29500)


def test_each_node_has_its_own_launch_file_and_logs_and_the_cluster_wait_is_configured(tmp_path):
    one = validate.prepare(validate.LaunchSpec("configs/dp2_cpu.yaml", 2, output=tmp_path / "r", master_port=29517))
    assert validate.node_files(one) == (tmp_path / "r" / "launch.yaml", tmp_path / "r" / "logs")
    assert "--cluster_time_out=120" in validate.command(one, *validate.node_files(one))
    two = validate.prepare(validate.LaunchSpec("configs/dp2_cpu.yaml", 1, output=tmp_path / "r", nodes=2,
                                               node_rank=1, master_addr="10.1.2.3", master_port=29500,
                                               overrides=["parallel.cluster_timeout_s=15"]))
    cfg, logs = validate.node_files(two)
    assert (cfg.name, logs.relative_to(tmp_path / "r").as_posix()) == ("launch_node1.yaml", "logs/node1")
    cmd = validate.command(two, cfg, logs)
    assert "--cluster_time_out=15" in cmd and f"--log_dir={logs}" in cmd and "--node_rank=1" in cmd


def test_the_report_names_the_node_that_never_joined(tmp_path):
    kw = dict(output=tmp_path / "r", nodes=2, master_addr="10.1.2.3", master_port=29500,
              overrides=["parallel.cluster_timeout_s=15"])
    gave_up = supervisor.Outcome(supervisor.FAILED, code=1, reason=supervisor.CLUSTER_NOT_GATHERED)
    node0 = validate.prepare(validate.LaunchSpec("configs/dp2_cpu.yaml", 1, node_rank=0, **kw))
    text = launch.missing_nodes(node0, gave_up)
    assert text.startswith("node 1 (rank 1) never joined the cluster within parallel.cluster_timeout_s = 15 s")
    node1 = validate.prepare(validate.LaunchSpec("configs/dp2_cpu.yaml", 2, node_rank=1, micro_batch=2, **kw))
    assert launch.missing_nodes(node1, gave_up).startswith("node 0 (ranks 0..1) never joined")
    assert launch.missing_nodes(node0, supervisor.Outcome(supervisor.FAILED, rank=1, code=-9)) is None


def test_one_msrun_builder():
    from labkit.parallel import msrun

    cluster = msrun.Cluster(4, 2, master_port=29500, master_addr="10.0.0.1", node_rank=1, cluster_time_out=30)
    line = msrun.msrun_args(cluster, log_dir="L", tail_worker_log=msrun.NO_TAIL)
    assert line == ["msrun", "--worker_num=4", "--local_worker_num=2", "--master_addr=10.0.0.1", "--node_rank=1",
                    "--master_port=29500", "--log_dir=L", "--join=True", "--cluster_time_out=30",
                    "--tail_worker_log=65535"]
    with pytest.raises(LabkitError, match="do not split"):
        msrun.msrun_args(msrun.Cluster(3, 2, master_port=29500), log_dir="L")


def test_workers_get_the_callers_python_first_on_path(tmp_path):
    env = validate.python_on_path({"PATH": "/usr/bin"}, tmp_path / "shim")
    first = Path(env["PATH"].split(os.pathsep)[0]) / "python"
    out = subprocess.run([str(first), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
    assert out.stdout.strip() == sys.prefix


def test_log_tail_shows_the_traceback_without_framework_chatter(tmp_path):
    log = tmp_path / "worker_1.log"
    log.write_text("[INFO] DISTRIBUTED(1) started\n2026 - mindformers[x] - INFO - built\n"
                   "train:  50%|5/10\rtrain:  60%|6/10\n"
                   "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: boom\n"
                   "2026 - mindformers[x] - WARNING - noise\n")
    tail = supervisor.log_tail(log)
    assert tail.startswith("Traceback") and tail.endswith("RuntimeError: boom")
    log.write_text("[INFO] only chatter\n")
    assert "ended from outside" in supervisor.log_tail(log)
    log.write_text("step\ntrain:  50%|5/10\rtrain:  60%|6/10\n")
    assert supervisor.log_tail(log).splitlines()[-1] == "train:  60%|6/10"


def test_failure_report_names_rank_reason_and_checkpoint():
    r = launch.LaunchResult(ok=False, returncode=-9, workers=2, output="o", metrics="o/metrics.jsonl", logs="o/logs",
                            failed_rank=1, reason="rank 1 (pid 7) was killed by signal SIGKILL (exit -9)",
                            log_tail="last words", checkpoint="o/checkpoints/step_000002")
    text = str(r)
    assert "FAILED: rank 1" in text and "last words" in text and "step_000002" in text and "--resume" in text
    assert json.loads(json.dumps(r.to_dict()))["failed_rank"] == 1


def test_dp2_config_is_tiny_cpu_split_over_two_workers():
    """Notebook 05's equivalence compares these two configs: they may differ only in how the batch is split."""
    dp, one = (yaml.safe_load((ROOT / "configs" / f).read_text()) for f in ("dp2_cpu.yaml", "tiny_cpu.yaml"))
    assert dp["model"] == one["model"] and dp["data"] == one["data"]
    differ = {k for k in set(dp["train"]) | set(one["train"]) if dp["train"].get(k) != one["train"].get(k)}
    assert differ == {"micro_batch", "global_batch"}
    assert dp["train"]["micro_batch"] * 2 == one["train"]["micro_batch"] == dp["train"]["global_batch"]
    assert load_run_config("configs/dp2_cpu.yaml").parallel.parallel_mode == "data_parallel"


def _labkit(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "GLOG_v": "3"})


def test_cli_dry_run_and_refusal_print_one_json_object(tmp_path):
    ok = _labkit("launch", "--config", "configs/dp2_cpu.yaml", "--output", str(tmp_path / "r"), "--dry-run",
                 "--json", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    payload = json.loads(ok.stdout)
    assert payload["parallel_mode"] == "data_parallel" and payload["global_batch"] == 8
    assert "--worker_num=2" in payload["command"]
    bad = _labkit("launch", "--config", "configs/dp2_cpu.yaml", "--output", str(tmp_path / "r"), "--micro-batch",
                  "3", "--json", cwd=tmp_path)
    assert bad.returncode == 2
    err = json.loads(bad.stdout)
    assert err["ok"] is False and "global_batch" in err["error"]
    assert not (tmp_path / "r").exists()
