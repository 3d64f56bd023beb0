"""Helpers for the OpenAI server tests: a real `vllm serve` subprocess on 127.0.0.1 and the
engine arguments the server and the offline reference share."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import httpx

API_KEY = "test-key-123"
SERVED_NAME = "tiny-moe"
# The server and the offline reference use exactly these engine arguments.
ENGINE_ARGS = {"max_model_len": 128, "max_num_seqs": 64, "moe_expert_cache_size": 3,
               "seed": 0}
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m vllm.entrypoints.cli.main serve MODEL ...` as a subprocess on 127.0.0.1."""

    def __init__(self, model: str, extra_args: list[str], log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = []
        for k, v in ENGINE_ARGS.items():
            flags += [f"--{k.replace('_', '-')}", str(v)]
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
               "--port", str(self.port), "--host", "127.0.0.1", *flags, *extra_args]
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total, found = 0.0, False
        for line in self.metrics().splitlines():
            m = re.match(r"^([\w:]+)(\{[^}]*\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == str(v) for k, v in labels.items()):
                total += float(m.group(3))
                found = True
        if not found:
            raise KeyError(f"metric {name}{labels} not in /metrics")
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
