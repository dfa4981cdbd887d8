"""How a run's processes were started: by SLURM (srun), by torchrun, or by Lightning itself. It is
checked against --devices and --num-nodes before anything starts (a mismatch would hang or train
twice), and said in each process's opening line, as Lightning detects it: SLURM first, where
srun started the process; Lightning ignores SLURM when its job name is "bash" or "interactive"
(`srun --pty bash`)."""
import functools
import os
import sys
import warnings

from run_keeping.errors import fail as refuse

INTERACTIVE = ("bash", "interactive")
# Lightning warns wherever srun exists but did not start the process (a cluster's login node, a
# one-process run on a GPU node). check_launch refuses the case where that matters (several
# SLURM tasks started without srun), and the opening line says what did start the run.
warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")


def tasks_per_node(text):
    """SLURM_NTASKS_PER_NODE: "4", or "4(x2)" for 4 tasks on each of 2 nodes."""
    return int(text.split("(")[0])


def check_launch(args, invoked, takes_devices):
    """One line, exit 2, where the processes that were started cannot be the run the flags ask
    for: srun's or torchrun's counts differ from --devices / --num-nodes, several SLURM tasks
    without srun, or several machines with no launcher to start them."""
    env, asked = os.environ, f"--devices {args.devices} --num-nodes {args.num_nodes}"
    first = int(env.get("SLURM_PROCID", env.get("RANK", "0"))) == 0  # says it for all of them
    fail = functools.partial(refuse, say=first)
    flags = "" if takes_devices else " (this script runs one process)"
    job = env.get("SLURM_JOB_NAME")
    if "SLURM_NTASKS" in env and job not in INTERACTIVE:
        ntasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
        if "SLURM_STEP_ID" not in env and ntasks > 1:
            fail(f"SLURM gave this job {ntasks} tasks, but this process was started without srun, "
                 f"so it would wait for the others forever: start it with srun {invoked(*sys.argv[1:])}")
        if "SLURM_NTASKS_PER_NODE" not in env:
            fail(f"SLURM started {ntasks} tasks with --ntasks, which does not say how many run "
                 "on each machine: use #SBATCH --ntasks-per-node (one task per GPU) instead")
        per_node = tasks_per_node(env["SLURM_NTASKS_PER_NODE"])
        if (per_node, nodes) != (args.devices, args.num_nodes):
            fail(f"SLURM started {per_node} task(s) per machine on {nodes} machine(s) "
                 f"(--ntasks-per-node {per_node}, --nodes {nodes}), but the flags ask for {asked}"
                 f"{flags}: make the two agree (one task per GPU)")
    elif "TORCHELASTIC_RUN_ID" in env:
        local, world = int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("WORLD_SIZE", "1"))
        if (local, world) != (args.devices, args.devices * args.num_nodes):
            fail(f"torchrun started {local} process(es) here and {world} in all, but the flags ask "
                 f"for {asked}{flags}: make --nproc-per-node and --nnodes agree with them")
    elif args.num_nodes > 1 and "NODE_RANK" not in env:
        inside = (f" Inside `srun --pty bash` (SLURM job name {job!r}) Lightning does not use "
                  "SLURM: submit the job script with sbatch instead." if job in INTERACTIVE else "")
        fail(f"--num-nodes {args.num_nodes}: processes on other machines need a launcher: srun in "
             "a SLURM job, or torchrun on each machine (README: Running on several machines)."
             f"{inside}")


def opening_line(fabric, rank, world_size):
    """Which launcher started this process, the world size and this process's rank."""
    env = os.environ
    cluster = type(getattr(getattr(fabric, "strategy", None), "cluster_environment", None)).__name__
    if cluster == "SLURMEnvironment":
        by = f"SLURM (job {env.get('SLURM_JOB_ID')}, srun task {env.get('SLURM_PROCID')})"
    elif cluster == "TorchElasticEnvironment":
        by = f"torchrun (node {env.get('GROUP_RANK', '0')}, local rank {env.get('LOCAL_RANK')})"
    elif world_size > 1:
        by = "Lightning, which started this machine's processes itself"
    else:
        by = None
    if env.get("SLURM_JOB_NAME") in INTERACTIVE and cluster != "SLURMEnvironment":
        by = (by or "you") + (f", inside SLURM job {env.get('SLURM_JOB_ID')}, whose name "
                              f"{env['SLURM_JOB_NAME']!r} makes Lightning ignore SLURM")
    if by is None:
        return "One process, started without a launcher."
    return f"Process {rank} of {world_size}, started by {by}."
