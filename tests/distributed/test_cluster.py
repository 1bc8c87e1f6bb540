"""The multi-node topology: docker/compose.yaml checked against the repository (its commands, its
health check's credentials, its build arguments against docker/Dockerfile, and what `make
compose-demo` relies on), the S3 service's commands run for real, and launch/cluster.sh (the
same topology as plain processes) run end to end: a node SIGKILLed mid-run, the job restarted,
every rank's loss bitwise equal. The images themselves are built and run by `make compose-demo`
(launch/compose_demo.py), not here: building them takes minutes, so .ci/run runs it after `make
test`, under the machine's container engine."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE = os.path.join(ROOT, "docker", "compose.yaml")
ENV_FILE = os.path.join(ROOT, "docker", "cluster.env")
NODE_SH = os.path.join(ROOT, "launch", "node.sh")


def compose() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


def env_file() -> dict[str, str]:
    from cluster import read_env_file

    return read_env_file(ENV_FILE)


def test_compose_names_only_what_exists():
    spec = compose()
    assert {"s3", "bucket", "node0", "node1"} <= set(spec["services"])
    for name, service in spec["services"].items():
        build = service.get("build")
        if build:
            assert os.path.isfile(os.path.join(ROOT, "docker", build["context"], build["dockerfile"])), name
        if "env_file" in service:
            assert os.path.isfile(os.path.join(ROOT, "docker", service["env_file"])), name
        command = service["command"]
        if command[0] == "python":
            script = os.path.join(ROOT, command[1])
            assert os.path.isfile(script), (name, command)
            if command[1] == "launch/seaweed.py":  # the subcommand and its options parse
                args = [a for a in command[2:]]
                result = subprocess.run([sys.executable, script, *args, "--help"], capture_output=True, text=True)
                assert result.returncode == 0, (name, result.stderr)
                for option in (a for a in args if a.startswith("--")):
                    assert option in result.stdout, (name, option)
        else:
            assert os.access(os.path.join(ROOT, command[0]), os.X_OK), (name, command)
        health = service.get("healthcheck", {}).get("test", [])
        if health:
            assert health[0] == "CMD" and health[1] == "python" and health[2] == "launch/seaweed.py", name
            result = subprocess.run([sys.executable, os.path.join(ROOT, health[2]), *health[3:], "--help"],
                                    capture_output=True, text=True)
            assert result.returncode == 0, (name, result.stderr)
            for option in (a for a in health[3:] if a.startswith("--")):
                assert option in result.stdout, (name, option)
    node = spec["services"]["node0"]
    assert node["command"] == ["launch/node.sh"] and spec["services"]["node1"]["command"] == ["launch/node.sh"]


def test_every_setting_node_sh_reads_is_provided_by_compose_and_by_cluster_sh():
    text = open(NODE_SH).read()
    defaulted = set(re.findall(r"\$\{(\w+):[=-]", text))
    needed = set(re.findall(r"\$\{?(\w+)", text)) - defaulted - {"0", "@"}
    node_env = compose()["services"]["node0"]["environment"]
    missing = needed - set(env_file()) - set(node_env)
    assert not missing, f"compose does not provide {missing} to launch/node.sh"
    cluster_py = open(os.path.join(ROOT, "launch", "cluster.py")).read()
    provided_by_script = set(env_file()) | set(re.findall(r'"(\w+)": ', cluster_py)) | {"AWS_ENDPOINT_URL"}
    missing = needed - provided_by_script
    assert not missing, f"launch/cluster.py does not provide {missing} to launch/node.sh"


def flag_value(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_s3_health_check_and_every_client_use_the_servers_credentials():
    # The health check once ran `seaweed.py ready` without them: SeaweedFS refused the probe ("The
    # access key ID you provided does not exist"), s3 never turned healthy and no trainer started.
    services = compose()["services"]
    serve = services["s3"]["command"]
    keys = (flag_value(serve, "--access-key"), flag_value(serve, "--secret-key"))
    health = services["s3"]["healthcheck"]["test"]
    assert health[3] == "ready" and (flag_value(health, "--access-key"), flag_value(health, "--secret-key")) == keys
    bucket = services["bucket"]["command"]
    assert (flag_value(bucket, "--access-key"), flag_value(bucket, "--secret-key")) == keys
    for node in ("node0", "node1"):
        env = services[node]["environment"]
        assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == keys, node
        assert env["AWS_ENDPOINT_URL"] == flag_value(bucket, "--endpoint") == f"http://s3:{flag_value(serve, '--s3-port')}"
    assert flag_value(bucket, "--bucket") == env_file()["S3_BUCKET"]


def dockerfile_args() -> dict[str, str]:
    text = open(os.path.join(ROOT, "docker", "Dockerfile")).read()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


def test_compose_build_args_are_the_dockerfiles_with_the_same_defaults():
    # Unset, the variables give the ordinary build (python:3.11-slim, PyTorch's CPU index);
    # make compose-demo sets them to docker/offline-base.sh's base where no registry answers.
    import compose_demo

    args = dockerfile_args()
    assert {"BASE", "TORCH_INDEX"} <= set(args)
    assert (args["BASE"], args["TORCH_INDEX"]) == (compose_demo.REGISTRY_BASE, compose_demo.REGISTRY_TORCH_INDEX)
    for name, service in compose()["services"].items():
        if "build" not in service:
            continue
        for arg, value in service["build"]["args"].items():
            variable, default = re.fullmatch(r"\$\{(\w+):-(.+)\}", value).groups()
            assert variable == f"DISTCKPT_{arg}" and default == args[arg], (name, arg, value)


def test_make_compose_demo_runs_the_demo_on_the_compose_file():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert "compose-demo" in re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()
    recipe = re.search(r"^compose-demo:.*\n\t(.+)$", makefile, re.M).group(1)
    assert "launch/compose_demo.py" in recipe
    # The demo needs no torch on the host: it runs under `python3 -I` (no .venv, no site dirs).
    result = subprocess.run(["python3", "-I", os.path.join(ROOT, "launch", "compose_demo.py"), "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    base = os.path.join(ROOT, "docker", "offline-base.sh")
    assert os.access(base, os.X_OK) and subprocess.run(["sh", "-n", base]).returncode == 0
    spec = compose()
    # The demo binds a host directory at /logs through DISTCKPT_LOGS and names runs with DISTCKPT_RUN.
    for node in ("node0", "node1"):
        service = spec["services"][node]
        assert service["volumes"] == ["${DISTCKPT_LOGS:-logs}:/logs"], node
        assert service["environment"]["LOSS_LOG"].startswith("/logs/${DISTCKPT_RUN")
        assert service["environment"]["CKPT_URL"] == f"s3://{env_file()['S3_BUCKET']}/${{DISTCKPT_RUN:-compose}}"


def test_dockerfile_copies_only_what_exists():
    text = open(os.path.join(ROOT, "docker", "Dockerfile")).read()
    for sources in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in sources.split():
            assert os.path.exists(os.path.join(ROOT, source)), source
    assert "torch==2.13.0" in text and "whl/cpu" in text  # the CPU build, pinned like the Makefile
    # .dockerignore sends only what is allowed back in (`!path`): every COPY source must be.
    ignore = [line.strip() for line in open(os.path.join(ROOT, ".dockerignore"))]
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    for sources in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in sources.split():
            assert source.split("/")[0] in allowed, source


def test_the_s3_service_commands_serve_answer_and_make_a_bucket(tmp_path):
    from seaweed import free_ports

    port = free_ports(1)[0]
    script = os.path.join(ROOT, "launch", "seaweed.py")
    server = subprocess.Popen([sys.executable, script, "serve", "--dir", str(tmp_path), "--s3-port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while subprocess.run([sys.executable, script, "ready", "--endpoint", endpoint],
                             capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and server.poll() is None, "the S3 service never became ready"
            time.sleep(1)
        made = subprocess.run([sys.executable, script, "make-bucket", "--endpoint", endpoint, "--bucket", "ckpt"],
                              capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        import s3fs
        from seaweed import options_for

        assert "ckpt" in s3fs.S3FileSystem(skip_instance_cache=True, **options_for(endpoint)).ls("")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=3)
        except subprocess.TimeoutExpired:  # SeaweedFS lingers ~15 s on SIGTERM; its data is throwaway here
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        # the `weed` process runs in a session of its own (SeaweedS3.start): killed with the
        # wrapper above before the wrapper's stop() reached it, it outlived the test
        _kill_processes_mentioning(str(tmp_path))


def _kill_processes_mentioning(text: str) -> None:
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            continue


@pytest.mark.slow
@pytest.mark.faults  # make test-faults; CI runs the same topology in containers (make compose-demo)
def test_cluster_sh_kills_a_node_and_the_job_resumes_bitwise(tmp_path):
    result = subprocess.run([os.path.join(ROOT, "launch", "cluster.sh"), "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=1200,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "node 1 logged step 15: SIGKILL to its agent and workers" in result.stdout
    assert "resumes: ['resumed from step 10 epoch 0']" in result.stdout
    assert "VERDICT: bitwise identical — 120 (rank, step) losses over 2 nodes" in result.stdout


@pytest.mark.slow
@pytest.mark.faults  # make test-faults
@pytest.mark.parametrize("replace", [False, True], ids=["node-back-with-its-disk", "node-replaced"])
def test_cluster_sh_with_two_tiers_resumes_from_the_right_tier(tmp_path, replace):
    # Saves at steps 10 and 20, each node into its own local dir (rank 0 ships the files to node 1).
    # Node 1 is killed after step 15: back with its disk, both nodes hold step 10 locally (every
    # 2nd save is durable, so S3 has nothing yet); replaced, its disk is empty, so every save is
    # made durable and the job resumes from S3.
    extra = ["--local-tier"] + (["--replace-node"] if replace else [])
    result = subprocess.run([os.path.join(ROOT, "launch", "cluster.sh"), "--workdir", str(tmp_path), *extra],
                            capture_output=True, text=True, timeout=1200,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    tier = "durable" if replace else "local"
    assert f"resumes: ['resumed from step 10 epoch 0 ({tier} tier)']" in result.stdout, result.stdout[-3000:]
    assert "VERDICT: bitwise identical — 120 (rank, step) losses over 2 nodes" in result.stdout
