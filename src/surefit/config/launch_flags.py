"""Where the processes of a run come from: ``--num_processes``, ``--nnodes``, ``--node_rank``, ``--master_addr``,
``--master_port`` and ``--join_timeout``, or the environment SLURM and torchrun set.

These are settings of the launch, not of the run: they are not saved in ``config.yaml`` (a run stopped on 2 machines
resumes on 1 or 4), and they are read before the run's config so that every problem with them is reported at once.

The names and meanings are torchrun's (``torch.distributed.run``): ``--nnodes`` machines, this one is ``--node_rank``
(0 .. nnodes-1), node 0 is reachable at ``--master_addr:--master_port``. ``--num_processes`` is the processes *on this
machine* (torchrun's ``--nproc_per_node``, accepted as an alias): every machine runs the same command and starts
only its own processes, so a per-machine count is the one each command can act on; on one machine it is also the
total, as before. (accelerate's ``--num_processes`` counts every machine's processes: on several machines the two
differ.)

Read from the environment, lowest first: ``MASTER_ADDR`` and ``MASTER_PORT``, then, inside an ``srun`` step,
SLURM's ``SLURM_STEP_NUM_NODES`` (``SLURM_NNODES``) when above 1, ``SLURM_NODEID``, the first host of ``SLURM_STEP_NODELIST``
(``SLURM_JOB_NODELIST``) and ``SLURM_GPUS_ON_NODE``; flags override both. Under a launcher that already started the
processes (``RANK`` and ``WORLD_SIZE`` set: torchrun, accelerate launch) nothing is launched and these flags are
refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from surefit.errors import ConfigError, Problem

# Flag -> the setting it gives; both spellings, and torchrun's name for the per-machine process count.
LAUNCH_FLAGS: dict[str, str] = {
    "--num_processes": "num_processes", "--num-processes": "num_processes",
    "--nproc_per_node": "num_processes", "--nproc-per-node": "num_processes",
    "--nnodes": "nnodes", "--node_rank": "node_rank", "--node-rank": "node_rank",
    "--master_addr": "master_addr", "--master-addr": "master_addr",
    "--master_port": "master_port", "--master-port": "master_port",
    "--join_timeout": "join_timeout", "--join-timeout": "join_timeout",
}

DEFAULT_PORT = 29500  # torchrun's
DEFAULT_JOIN_TIMEOUT = 600  # seconds; torchrun's rendezvous default


@dataclass(frozen=True)
class LaunchFlags:
    """How many processes to start where, validated.

    Attributes:
        num_processes: processes on this machine (torchrun's ``--nproc_per_node``).
        nnodes: machines in the run.
        node_rank: this machine's index; node 0 holds the global main process (rank 0) and the rendezvous.
        master_addr: node 0's address, as every machine reaches it; ``None`` on one machine.
        master_port: the port of the rendezvous on node 0.
        join_timeout: seconds node 0 waits for every machine to join (and the others try to reach node 0).
        slurm: the node settings came from SLURM's environment (``srun surefit train ...``).
    """

    num_processes: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_PORT
    join_timeout: int = DEFAULT_JOIN_TIMEOUT
    slurm: bool = False

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def launches(self) -> bool:
        """Whether surefit must start the processes (several here, or this machine is one of several)."""
        return self.num_processes > 1 or self.multi_node

    def world_size(self) -> int:
        return self.num_processes * self.nnodes

    def ranks_of(self, node: int) -> range:
        """The global ranks torchrun gives a node's processes (each node's are contiguous, node 0's first)."""
        return range(node * self.num_processes, (node + 1) * self.num_processes)

    def relaunch_flags(self) -> str:
        """The flags that start the same processes again (``--node_rank`` is this machine's)."""
        if self.slurm:
            return ""  # srun gives every node its own settings again
        if not self.multi_node:
            return f" --num_processes {self.num_processes}" if self.num_processes > 1 else ""
        return (f" --num_processes {self.num_processes} --nnodes {self.nnodes} --node_rank {self.node_rank} "
                f"--master_addr {self.master_addr} --master_port {self.master_port}")


    def relaunch_note(self) -> str:
        """What to say after a command that starts this run again, when one command line does not fit every node."""
        if self.slurm:
            return " (in an allocation of the same shape)"
        if self.multi_node:
            return f" (on every node, each with its own --node_rank from 0 to {self.nnodes - 1})"
        return ""


def under_launcher(env: Mapping[str, str]) -> bool:
    """Whether this process was started by a launcher (torchrun, accelerate launch) as one rank of a run."""
    return bool(env.get("RANK")) and bool(env.get("WORLD_SIZE"))


def split_launch_flags(argv: Sequence[str], env: Mapping[str, str]) -> tuple[LaunchFlags | None, list[str]]:
    """``(the launch settings, the other arguments)`` from ``surefit train`` arguments and the environment.

    ``None`` when nothing asks for a launch: no launch flag, and no SLURM step or ``MASTER_*`` variables that say
    this machine is one of several. Every problem (a flag without a whole number, ``--node_rank`` past
    ``--nnodes``, a missing ``--master_addr``, a port out of range, flags given under a launcher, SLURM tasks that
    are not one per node) is collected and raised together.

    Raises:
        ConfigError: every problem found, each naming the flag or variable and the fix.
    """
    given: dict[str, tuple[str, str]] = {}  # setting -> (raw value, the flag as typed)
    rest: list[str] = []
    problems: list[Problem] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok.partition("=")
        setting = LAUNCH_FLAGS.get(name)
        if setting is None:
            rest.append(tok)
        elif eq:
            given[setting] = (value, name)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            given[setting] = (argv[i + 1], name)
            i += 1
        else:
            problems.append(Problem("no value given", name, f"e.g. {name} {_EXAMPLE[setting]}"))
        i += 1

    if under_launcher(env):
        # The processes exist already; a count or node given here could only disagree with the launcher's.
        for setting, (raw, flag) in given.items():
            if setting == "num_processes" and _whole(raw) == _int(env.get("LOCAL_WORLD_SIZE") or env["WORLD_SIZE"]):
                continue  # says what the launcher did: harmless
            problems.append(Problem(f"{flag} {raw} given inside a launcher that started {env['WORLD_SIZE']} processes",
                                    flag, f"leave {flag} out under torchrun or accelerate launch: the "
                                    "launcher's settings apply"))
        if problems:
            raise ConfigError(problems)
        return None, rest

    values: dict[str, tuple[str, str]] = {}  # setting -> (raw, where it came from)
    if env.get("MASTER_ADDR"):
        values["master_addr"] = (env["MASTER_ADDR"], "MASTER_ADDR (environment)")
    if env.get("MASTER_PORT"):
        values["master_port"] = (env["MASTER_PORT"], "MASTER_PORT (environment)")
    # Inside an srun step over several nodes (on one node, SLURM changes nothing: the flags decide, as before).
    slurm = bool(env.get("SLURM_PROCID")) and (_int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")) or 1) > 1
    if slurm:
        values.update(_from_slurm(env, "num_processes" in given, problems))
    values.update({setting: (raw, flag) for setting, (raw, flag) in given.items()})
    if not given and not slurm:
        if problems:
            raise ConfigError(problems)
        return None, rest

    flags = _validate(values, problems)
    if problems:
        raise ConfigError(problems)
    assert flags is not None
    return LaunchFlags(**{**flags.__dict__, "slurm": slurm and "nnodes" not in given}), rest


_EXAMPLE = {"num_processes": "2", "nnodes": "2", "node_rank": "0", "master_addr": "10.0.0.1", "master_port": "29500",
            "join_timeout": "600"}


def _from_slurm(env: Mapping[str, str], count_given: bool, problems: list[Problem]) -> dict[str, tuple[str, str]]:
    """Node settings from an ``srun`` step: one task per node, each task starting its node's processes."""
    out: dict[str, tuple[str, str]] = {}
    nodes_var = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES"
    tasks_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    if env.get(nodes_var):
        out["nnodes"] = (env[nodes_var], f"{nodes_var} (environment)")
    if env.get("SLURM_NODEID"):
        out["node_rank"] = (env["SLURM_NODEID"], "SLURM_NODEID (environment)")
    nodelist_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    if env.get(nodelist_var) and not env.get("MASTER_ADDR"):
        out["master_addr"] = (first_host(env[nodelist_var]), f"the first host of {nodelist_var} (environment)")
    if not env.get("MASTER_PORT") and _int(env.get("SLURM_JOB_ID")) is not None:
        # Two jobs sharing a machine would both take torchrun's 29500; the job id spreads them out.
        out["master_port"] = (str(DEFAULT_PORT + (_int(env.get("SLURM_JOB_ID")) or 0) % 1000),
                              "29500 + SLURM_JOB_ID mod 1000")
    if not count_given and _int(env.get("SLURM_GPUS_ON_NODE")):
        out["num_processes"] = (env["SLURM_GPUS_ON_NODE"], "SLURM_GPUS_ON_NODE (environment)")
    nodes, tasks = _int(env.get(nodes_var)), _int(env.get(tasks_var))
    if nodes is not None and tasks is not None and tasks != nodes:
        problems.append(Problem(
            f"SLURM started {tasks} tasks on {nodes} nodes; surefit starts the processes of each node itself, so it "
            "needs one task per node", f"{tasks_var} (environment)",
            "srun --ntasks-per-node 1 surefit train ... --num_processes GPUS_PER_NODE (or #SBATCH --ntasks-per-node=1)"))
    return out


def _validate(values: dict[str, tuple[str, str]], problems: list[Problem]) -> LaunchFlags | None:
    """The settings as numbers, every problem appended to ``problems``."""
    def number(setting: str, default: int, low: int, high: int | None = None) -> int:
        if setting not in values:
            return default
        raw, where = values[setting]
        n = _whole(raw)
        if n is None or n < low or (high is not None and n > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            problems.append(Problem(f"expected a whole number {bound}, got {raw!r}", where,
                                    f"e.g. {where} {_EXAMPLE[setting]}" if where.startswith("--") else
                                    f"e.g. {where.split()[0]}={_EXAMPLE[setting]}"))
            return default
        return n

    processes = number("num_processes", 1, 1)
    nnodes = number("nnodes", 1, 1)
    node_rank = number("node_rank", 0, 0)
    port = number("master_port", DEFAULT_PORT, 1, 65535)
    timeout = number("join_timeout", DEFAULT_JOIN_TIMEOUT, 1)
    if "node_rank" in values and "nnodes" in values and node_rank >= nnodes and _whole(values["node_rank"][0]) is not None:
        problems.append(Problem(f"node rank {node_rank} with {nnodes} node{'s' if nnodes != 1 else ''}: the nodes are "
                                f"numbered 0 to {nnodes - 1}", values["node_rank"][1],
                                f"give each machine its own --node_rank from 0 to {nnodes - 1}, or raise --nnodes"))
    elif "node_rank" in values and node_rank > 0 and "nnodes" not in values:
        problems.append(Problem(f"node rank {node_rank} without --nnodes (one machine has only node 0)",
                                values["node_rank"][1], "add --nnodes, the number of machines"))
    addr = values["master_addr"][0].strip() if "master_addr" in values else None
    if "master_addr" in values and (not addr or any(c.isspace() for c in addr)):
        problems.append(Problem(f"expected a host name or IP address, got {values['master_addr'][0]!r}",
                                values["master_addr"][1], "e.g. --master_addr 10.0.0.1 (node 0's address)"))
    if nnodes > 1 and not addr and "master_addr" not in values:
        problems.append(Problem(f"{nnodes} nodes and no address of node 0, where the other nodes meet",
                                "--master_addr", "add --master_addr HOST (node 0's host name or IP address, the same "
                                "on every node) and --master_port PORT"))
    return LaunchFlags(num_processes=processes, nnodes=nnodes, node_rank=node_rank, master_addr=addr or None,
                       master_port=port, join_timeout=timeout)


def _whole(raw: str | None) -> int | None:
    return int(raw) if raw is not None and re.fullmatch(r"\s*\d+\s*", raw) else None


def _int(raw: str | None) -> int | None:
    return _whole(raw.split("(")[0]) if raw else None  # SLURM writes "2(x3)" for repeated counts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    return expand_hosts(nodelist)[0] if nodelist.strip() else ""


def expand_hosts(nodelist: str) -> list[str]:
    """Every host of a SLURM host list, in order: ``"gpu[07-08],cpu1"`` -> ``["gpu07", "gpu08", "cpu1"]``.

    Handles the compressed form SLURM writes (ranges keep their zero padding, several bracket groups per name).
    """
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        expanded = [""]
        for text, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if not text and not group:
                continue
            choices = [text]
            if group:
                choices = []
                for part in group.split(","):
                    lo, _, hi = part.partition("-")
                    if hi and lo.isdigit() and hi.isdigit():
                        choices += [f"{text}{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)]
                    else:
                        choices.append(f"{text}{lo}")
            expanded = [e + c for e in expanded for c in choices]
        hosts += [h for h in expanded if h]
    return hosts
