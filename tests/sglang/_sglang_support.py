"""The real SGLang 0.5.23 server as a test dependency (CPU, toy checkpoints).

No mocks: :class:`SGLangServer` runs ``python -m sglang.launch_server`` from the virtualenv that
``scripts/sglang-cpu.sh`` builds (cached outside the repo), with ``scripts/sglang_cpu/pythonpath``
on its ``PYTHONPATH`` (the pure-torch ``sgl_kernel`` stand-in and two environment fixes; see
docs/gateway.md "Real SGLang in the test bed").

* :func:`sglang_python` -- the venv's python; builds the venv on first use.
* :func:`write_checkpoint` -- a toy Qwen3-MoE checkpoint written by the reference engine's
  ``init_checkpoint`` plus a byte-level HF tokenizer (:func:`write_byte_tokenizer`) whose ids are
  the project's ``ByteTokenizer``'s, so text prompts and chat work through SGLang's own
  tokenizer path.
* :class:`SGLangServer` -- one server process group: ``start()`` waits for ``/health`` 200 while
  watching the process; ``stop()`` sends SIGTERM, then SIGKILLs the whole process group;
  ``kill()`` SIGKILLs it at once; ``signal_group(SIGSTOP/SIGCONT)`` freezes and thaws it;
  ``restart(model_path=..., weight_version=...)`` relaunches on the same port.

Launch flags (see :meth:`SGLangServer.command`): ``--device cpu --attention-backend torch_native
--disable-cuda-graph --dtype float32 --max-total-tokens 65536 --enable-return-routed-experts
--weight-version V --sleep-on-idle``, plus per server: ``--disable-overlap-schedule`` (default: SGLang's overlap
scheduler), ``--skip-tokenizer-init``, ``--incremental-streaming-output``, ``extra_args``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rollout_gateway.commands.engine_process import free_port

REPO = Path(__file__).resolve().parents[2]
SETUP_SCRIPT = REPO / "scripts" / "sglang-cpu.sh"
STAND_IN_PATH = REPO / "scripts" / "sglang_cpu" / "pythonpath"
SGLANG_VERSION = "0.5.23"
START_TIMEOUT_S = float(os.environ.get("SGLANG_TEST_START_TIMEOUT", "300"))
STOP_GRACE_S = 15.0

#: every server started and not yet stopped (the conftest shows their logs on failure)
LIVE: list[SGLangServer] = []


class SGLangStartError(RuntimeError):
    """The server exited, or did not answer /health 200 in time (message: the log's tail)."""


# ---------------------------------------------------------------------------------------------
# the virtualenv


_python: str | None = None


def sglang_python() -> str:
    """The python of SGLang's virtualenv, built by scripts/sglang-cpu.sh if it is not ready
    (a no-op taking milliseconds when it is)."""
    global _python
    if _python is None:
        proc = subprocess.run(["bash", str(SETUP_SCRIPT)], capture_output=True, text=True,
                              timeout=1800, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"scripts/sglang-cpu.sh failed ({proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        _python = proc.stdout.strip().splitlines()[-1]
    return _python


# ---------------------------------------------------------------------------------------------
# checkpoints and the tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


#: The chat template of ``rollout_gateway.sessions.templates.ReferenceTemplate`` in Jinja:
#: ``<|bos|>[<|tools|>\n{tools json}<|eos|>\n]<|{role}|>\n{content}[tool calls]<|eos|>\n...``
#: then ``<|assistant|>\n`` as the generation prompt. Only <|bos|> and <|eos|> are special ids.
CHAT_TEMPLATE = (
    "{{- '<|bos|>' -}}"
    "{%- if tools %}{{- '<|tools|>\\n' + (tools | tojson) + '<|eos|>\\n' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|' + m['role'] + '|>\\n' -}}"
    "{%- if m['content'] is string -%}{{- m['content'] -}}"
    "{%- elif m['content'] -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in (m['tool_calls'] or []) -%}"
    "{%- set fn = call['function'] -%}"
    "{%- if fn['arguments'] is string -%}"
    "{{- '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' "
    "+ fn['arguments'] + '}</tool_call>' -}}"
    "{%- else -%}"
    "{{- '<tool_call>' + ({'name': fn['name'], 'arguments': fn['arguments']} | tojson) "
    "+ '</tool_call>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<|eos|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def write_byte_tokenizer(directory: str | os.PathLike) -> Path:
    """``tokenizer.json`` + ``tokenizer_config.json``: a Hugging Face ``tokenizers`` byte-level
    model whose ids equal ``reference_engine.tokenizer.ByteTokenizer``'s (byte b -> id b,
    ``<|bos|>`` 256, ``<|eos|>`` 257, ``<|pad|>`` 258), with :data:`CHAT_TEMPLATE`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from reference_engine.tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIAL_NAMES

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SPECIAL_NAMES[i], special=True, normalized=False)
                            for i in (BOS_ID, EOS_ID, PAD_ID)])
    for i in (BOS_ID, EOS_ID, PAD_ID):
        if tok.token_to_id(SPECIAL_NAMES[i]) != i:
            raise AssertionError(f"special {SPECIAL_NAMES[i]} did not get id {i}")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_NAMES[BOS_ID],
        "eos_token": SPECIAL_NAMES[EOS_ID],
        "pad_token": SPECIAL_NAMES[PAD_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    return d


def write_checkpoint(directory: str | os.PathLike, seed: int, *, tokenizer: bool = True) -> Path:
    """A toy checkpoint (``reference_engine.checkpoint.init_checkpoint``, default toy config,
    weights drawn from ``seed``) that SGLang loads as ``Qwen3MoeForCausalLM``; with the byte
    tokenizer beside it unless ``tokenizer=False``."""
    from reference_engine.checkpoint import init_checkpoint

    d = init_checkpoint(directory, seed=seed)
    if tokenizer:
        write_byte_tokenizer(d)
    return d


@dataclass(frozen=True)
class Checkpoints:
    """Toy checkpoints, one per weight version: ``path(v)``, ``seed(v)``."""

    root: Path
    seeds: dict[str, int]

    def path(self, version: str | int) -> Path:
        return self.root / f"v{version}"

    def seed(self, version: str | int) -> int:
        return self.seeds[str(version)]

    @classmethod
    def build(cls, root: Path, seeds: dict[str, int]) -> Checkpoints:
        for version, seed in seeds.items():
            write_checkpoint(root / f"v{version}", seed)
        return cls(root=root, seeds=dict(seeds))


# ---------------------------------------------------------------------------------------------
# the server


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies (PR_SET_PDEATHSIG), so a
    killed pytest leaves no server behind (SGLang then shuts its own children down)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def _stop_all_live() -> None:
    for srv in LIVE[:]:  # stop() removes it from LIVE
        srv.stop()


atexit.register(_stop_all_live)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _wait_exit(pids: list[int], timeout: float) -> list[int]:
    """Wait (on pidfds: woken by each exit, no polling) until every process in ``pids`` has
    exited or ``timeout`` passed; returns those still alive."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            pass
    try:
        deadline = time.monotonic() + timeout
        pending = set(fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select(list(pending), [], [], left)
            pending -= set(ready)
        return [fds[fd] for fd in pending]
    finally:
        for fd in fds:
            os.close(fd)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` and wait until all have exited."""
    for _ in range(5):  # a member might fork while we kill: go again
        members = _group_members(pgid)
        if not members:
            return
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        _wait_exit(members, STOP_GRACE_S)
    left = _group_members(pgid)
    if left:
        raise RuntimeError(f"process group {pgid} survived SIGKILL: {left}")


@dataclass
class SGLangServer:
    """One real SGLang server (3 processes: HTTP/tokenizer, scheduler, detokenizer, plus
    multiprocessing's resource tracker) in its own process group.

    ``model_path``: a checkpoint dir (with the byte tokenizer unless ``skip_tokenizer_init``).
    ``overlap_schedule``: SGLang's default overlap scheduler (False:
    ``--disable-overlap-schedule``).
    """

    model_path: Path
    weight_version: str = "0"
    overlap_schedule: bool = True
    skip_tokenizer_init: bool = False
    incremental_streaming_output: bool = False
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    name: str = "sglang"
    host: str = "127.0.0.1"
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    start_seconds: float | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        cmd = [sglang_python(), "-m", "sglang.launch_server",
               "--model-path", str(self.model_path), "--device", "cpu",
               "--host", self.host, "--port", str(self.port),
               "--attention-backend", "torch_native", "--disable-cuda-graph",
               "--dtype", "float32", "--max-total-tokens", "65536",
               "--enable-return-routed-experts", "--weight-version", str(self.weight_version),
               # idle, the scheduler waits on its sockets instead of spinning a core (several
               # servers sit idle beside the rest of the suite on a 2-core machine)
               "--sleep-on-idle"]
        if not self.overlap_schedule:
            cmd.append("--disable-overlap-schedule")
        if self.skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        if self.incremental_streaming_output:
            cmd.append("--incremental-streaming-output")
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")}
        env.update({
            "SGLANG_USE_CPU_ENGINE": "1",  # is_cpu() is False without it
            "PYTHONPATH": str(STAND_IN_PATH),  # the stand-in and fixes, nothing of ours else
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        })
        env.update(self.env)
        return env

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT_S) -> SGLangServer:
        """Launch and wait until ``/health`` answers 200 (SGLang answers 503 until its warm-up
        request is done). Raises :class:`SGLangStartError` with the log's tail if the process
        exits first or the deadline passes (the process group is stopped then)."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        if self.log_path is None:
            import tempfile
            self.log_path = Path(tempfile.mkstemp(prefix=f"{self.name}-", suffix=".log")[1])
        cmd = self.command()
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n".encode())
            log.flush()
            t0 = time.monotonic()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.environment(),
                                         cwd=str(self.log_path.parent), start_new_session=True,
                                         preexec_fn=_die_with_parent)  # noqa: PLW1509 (prctl only)
        LIVE.append(self)
        why = self._wait_healthy(timeout)
        if why is not None:
            self.stop()
            raise SGLangStartError(f"{self.name}: {why}; log {self.log_path}:\n{self.log_tail()}")
        self.start_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return f"exited with code {self.proc.returncode} before /health answered"
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return None
                except httpx.HTTPError:
                    pass
                try:  # wait on the process itself between probes
                    self.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        return f"/health did not answer 200 within {timeout:g}s"

    def stop(self) -> None:
        """SIGTERM to the server (it shuts its children down), then SIGKILL to whatever is left
        of its process group; returns once no process of the group is alive."""
        proc, self.proc = self.proc, None
        if self in LIVE:
            LIVE.remove(self)
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        if proc.poll() is not None:  # it died on its own (a crash, the OOM killer: -9)
            self.note(f"found exited on its own, exit status {proc.returncode}")
        try:
            os.killpg(pgid, signal.SIGCONT)  # a group a test froze with SIGSTOP cannot stop
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _wait_exit(_group_members(pgid), 5.0)  # its children, shut down by the server
        _kill_group(pgid)
        proc.wait()

    def test_notes(self) -> str:
        """The test side's lines in the log: every start (with its command) and note."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(line[:300] for line in f if line.startswith("===== "))

    def note(self, what: str) -> None:
        """A line in the server's log from the test side (it shows in failure reports)."""
        if self.log_path is not None:
            with open(self.log_path, "a") as log:
                log.write(f"===== {time.strftime('%H:%M:%S')}: {self.name} {what}\n")

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, as a test may want)."""
        proc, self.proc = self.proc, None
        if self in LIVE:
            LIVE.remove(self)
        if proc is not None:
            _kill_group(proc.pid)
            proc.wait()

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to every process of the server (e.g. SIGSTOP / SIGCONT to freeze it:
        the port stays open, nothing answers)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not running")
        os.killpg(self.proc.pid, sig)

    def restart(self, *, model_path: str | os.PathLike | None = None,
                weight_version: str | int | None = None, timeout: float = START_TIMEOUT_S,
                **options) -> SGLangServer:
        """Stop, then start again on the same port (optionally with another checkpoint,
        weight version or any other field, e.g. ``overlap_schedule=False``)."""
        self.stop()
        if model_path is not None:
            self.model_path = Path(model_path)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        for k, v in options.items():
            if not hasattr(self, k) or k in ("proc", "port", "host"):
                raise TypeError(f"restart(): unknown option {k!r}")
            setattr(self, k, v)
        return self.start(timeout)

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- inspection ------------------------------------------------------------------------

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def processes(self) -> list[int]:
        return _group_members(self.proc.pid) if self.proc else []

    def rss_bytes(self) -> int:
        """Resident memory of every process of the server's group, added up."""
        return sum(_rss_bytes(p) for p in self.processes())

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))

    def model_info(self) -> dict:
        return httpx.get(self.url + "/model_info", timeout=10).json()

    def server_info(self) -> dict:
        return httpx.get(self.url + "/server_info", timeout=10).json()
