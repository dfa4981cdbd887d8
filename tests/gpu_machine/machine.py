"""A GPU machine stood in for, whole, from one description, so that what nvidia-smi lists and what torch sees agree,
and fail as the real ones fail: the nvidia-smi beside this file answers as the machine's would (answer), and
stand_in gives a test's torch.cuda the same machine's answers, CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER honoured as
CUDA honours them, torch's own checks run as CUDA starts, its own words where it cannot use the GPUs.

The description is HOOK_GPU_MACHINE's value: "0", a machine with a driver and no GPU (the suite's default, so that
torch seeing no GPU on a CPU host is the machine's truth), "no driver" (nvidia-smi fails as it does where no driver
is loaded), "mismatch" (the driver's kernel module and its library differ, until a reboot), or GPUs,
"COUNT x MODEL[, driver VERSION][, compute_cap X.Y][, memory MIB][, mig][, modules proprietary][, rocm]", several
such joined by " + " for a machine of mixed GPUs, in nvidia-smi's (PCI) order. `mig`: the GPUs split into MIG
instances (NVML counts the GPUs, CUDA one instance); `modules proprietary`: a driver without the open kernel modules,
which a Blackwell GPU needs (nvidia-smi finds no device); `rocm`: AMD GPUs, which no NVIDIA driver lists (torch sees
them with a ROCm build). For example "4 x NVIDIA H100 80GB HBM3, driver 550.54.15"; "1" is one H100 on driver
570.124.06. Only the standard library: nvidia-smi runs this file with any python3."""

import os
import re
import sys
import types
import uuid

SETTING = "HOOK_GPU_MACHINE"  # HOOK_*: a forked warm start may differ in it (tests/warm_start.py)
DEFAULT = "0"
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
             "Make sure that the latest NVIDIA driver is installed and running.")
NO_DEVICES = "No devices were found"
MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.95"
# torch's own words (libc10_cuda.so, torch 2.14.1): the driver older than the build; cudaGetDeviceCount's error
TOO_OLD = ("The NVIDIA driver on your system is too old (found version {found}). Please update your GPU driver by "
           "downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx "
           "Alternatively, go to: https://pytorch.org to install a PyTorch version that has been compiled with your "
           "version of the CUDA driver.")
DEVICE_COUNT_ERROR = ("CUDA initialization: Unexpected error from cudaGetDeviceCount(). Did you run some cuda "
                      "functions before calling NumCudaDevices() that might have already set an error? Error 803: "
                      "system has unsupported display driver / cuda driver combination")
# Each model's memory (MiB) and compute capability, as nvidia-smi gives them (an AMD GPU's as torch gives it)
MODELS = {"NVIDIA H100 80GB HBM3": (81559, "9.0"), "NVIDIA H200": (143771, "9.0"),
          "NVIDIA A100-SXM4-80GB": (81920, "8.0"), "NVIDIA B200": (183359, "10.0"),
          "NVIDIA GeForce RTX 5090": (32607, "12.0"), "Tesla V100-SXM2-16GB": (16384, "7.0"),
          "Tesla T4": (15360, "7.5"), "AMD Instinct MI300X": (196592, "9.4")}
DRIVER = "570.124.06"
# The newest CUDA each driver branch supports (nvidia-smi's "CUDA Version"), from its first release of the branch
DRIVER_CUDA = {450: "11.0", 460: "11.2", 470: "11.4", 510: "11.6", 515: "11.7", 520: "11.8", 525: "12.0", 530: "12.1",
               535: "12.2", 545: "12.3", 550: "12.4", 555: "12.5", 560: "12.6", 565: "12.7", 570: "12.8", 575: "12.9",
               580: "13.0"}
# The architectures each CUDA build of torch carries kernels for, as PyTorch's wheel build script sets them
# (TORCH_CUDA_ARCH_LIST in pytorch/pytorch .ci/manywheel/build_cuda.sh, read at commit 00c7a380b836: 12.6
# "5.0;6.0;7.0;7.5;8.0;8.6;9.0", 12.8 "7.0;7.5;8.0;8.6;9.0;10.0;12.0"); 13.0's read off torch 2.14.1+cu130 here
# (torch.cuda.get_arch_list(); torch.cuda.PYTORCH_RELEASES_CODE_CC gives the same for x86_64). An AMD build's,
# as torch names them (gfx942: the MI300X).
ARCHS = {"12.6": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
         "12.8": ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
         "13.0": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
         "rocm": ["gfx90a", "gfx942"]}
COMPUTE_CAP_FROM = 510  # nvidia-smi knows the compute_cap field from this driver branch on
# The oldest Linux driver a build of each CUDA major runs on (NVIDIA's minor-version compatibility: CUDA Toolkit
# release notes, table 3), the machine's own fact; a Blackwell GPU is listed by the driver from the R570 branch on,
# and only with its open kernel modules
FLOORS = {"11": (450, 80, 2), "12": (525, 60, 13), "13": (580, 65, 6)}
BLACKWELL_DRIVER = (570,)


def version(text):
    return tuple(int(part) for part in re.findall(r"\d+", text or ""))


def machine(description=None):
    """{"driver": VERSION, None where none is loaded, or "mismatch"; "gpus": [each GPU, in PCI order], "mig":
    whether they are split into MIG instances, "rocm": whether they are AMD's}."""
    text = (os.environ.get(SETTING, DEFAULT) if description is None else description).strip()
    if text.lower() in ("no driver", "mismatch"):
        return {"driver": None if text.lower() == "no driver" else "mismatch", "gpus": [], "mig": False, "rocm": False}
    gpus, driver, mig, rocm = [], DRIVER, False, False
    for part in filter(None, (p.strip() for p in text.split("+"))):
        head, *settings = [s.strip() for s in part.split(",")]
        count, _, model = head.partition("x")
        model = model.strip() or "NVIDIA H100 80GB HBM3"
        said = dict((s.split(" ", 1) + [""])[:2] for s in settings)
        driver = said.get("driver", driver)
        mig, rocm = mig or "mig" in said, rocm or "rocm" in said
        memory, cap = MODELS.get(model, (81920, None))
        cap = said.get("compute_cap", cap)
        assert cap, f"{model}: no compute capability known; give it: compute_cap X.Y"
        for _ in range(int(count)):
            index = len(gpus)
            listed = not (version(cap) >= (10,) and (version(driver) < BLACKWELL_DRIVER or "modules" in said))
            gpus.append({"index": str(index), "name": model, "memory": int(said.get("memory", memory)), "cap": cap,
                         "uuid": f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{index}.{model}.gpu-machine')}",
                         "pci.bus_id": f"00000000:{0x18 + 0x10 * index:02X}:00.0", "listed": listed})
    return {"driver": driver, "gpus": gpus, "mig": mig, "rocm": rocm}


def field(gpu, name, driver, units, mig):
    values = {"index": gpu["index"], "name": gpu["name"], "gpu_name": gpu["name"], "uuid": gpu["uuid"],
              "gpu_uuid": gpu["uuid"], "driver_version": driver, "compute_cap": gpu["cap"],
              "memory.total": f"{gpu['memory']}{' MiB' if units else ''}", "pci.bus_id": gpu["pci.bus_id"],
              "mig.mode.current": "Enabled" if mig else "Disabled", "compute_mode": "Default"}
    return values[name]


def answer(argv, description=None):
    """What this machine's nvidia-smi prints for `argv`, and its exit code."""
    found = machine(description)
    driver, mig = found["driver"], found["mig"]
    if driver is None or found["rocm"]:
        return NO_DRIVER, 9
    if driver == "mismatch":
        return MISMATCH, 18
    gpus = [g for g in found["gpus"] if g["listed"]]
    options, args = {}, iter(argv)
    for a in args:  # --query-gpu=name or --query-gpu name, -i 0
        name, equals, value = a.partition("=")
        options[name] = value if equals or name not in ("-i", "--id", "--query-gpu", "--format") else next(args, "")
    if "-i" in options or "--id" in options:
        ids = (options.get("-i") or options.get("--id") or "").split(",")
        gpus = [g for g in gpus if g["index"] in ids or g["uuid"] in ids or g["pci.bus_id"] in ids]
    if not gpus:
        return NO_DEVICES, 6
    if "--query-gpu" in options:
        return query(gpus, driver, options["--query-gpu"], options.get("--format") or "", mig)
    if "-L" in options or "--list-gpus" in options:
        lines = []
        for g in gpus:
            lines.append(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
            if mig:
                lines.append(f"  MIG 1g.10gb     Device  0: (UUID: MIG-{uuid.uuid5(uuid.NAMESPACE_DNS, g['uuid'])})")
        return "\n".join(lines), 0
    cuda = DRIVER_CUDA[max(b for b in DRIVER_CUDA if b <= version(driver)[0])] if version(driver)[0] >= 450 else "11.0"
    if "-q" in options:
        each = [f"GPU {g['pci.bus_id']}\n    Product Name : {g['name']}\n    GPU UUID : {g['uuid']}" for g in gpus]
        head = [f"Driver Version : {driver}", f"CUDA Version : {cuda}", f"Attached GPUs : {len(gpus)}"]
        return "\n".join([*head, *each]), 0
    table = [f"| {g['index']:>3}  {g['name']:<30} | {g['pci.bus_id']} | {g['memory']}MiB |" for g in gpus]
    return "\n".join([f"| NVIDIA-SMI {driver}   Driver Version: {driver}   CUDA Version: {cuda} |", *table]), 0


def query(gpus, driver, fields, form, mig):
    names = [f.strip() for f in fields.split(",")]
    known = {"index", "name", "gpu_name", "uuid", "gpu_uuid", "driver_version", "memory.total", "pci.bus_id",
             "mig.mode.current", "compute_mode"}
    known |= {"compute_cap"} if version(driver)[0] >= COMPUTE_CAP_FROM else set()
    unknown = [n for n in names if n not in known]
    if unknown or not form.startswith("csv"):
        return (f'Field "{unknown[0]}" is not a valid field to query.' if unknown else '"--format" is needed'), 2
    units = "nounits" not in form
    rows = [", ".join(field(g, n, driver, units, mig) for n in names) for g in gpus]
    header = ", ".join(n + (" [MiB]" if n == "memory.total" and units else "") for n in names)
    return "\n".join(rows if "noheader" in form else [header, *rows]), 0


def cuda_order(gpus, environ):
    """The GPUs as CUDA numbers them: fastest first (here: the highest compute capability first, then nvidia-smi's
    order), or nvidia-smi's PCI order where CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    if environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return list(gpus)
    return sorted(gpus, key=lambda g: (-version(g["cap"])[0], -version(g["cap"])[1], int(g["index"])))


def visible(gpus, environ):
    """The GPUs CUDA_VISIBLE_DEVICES lets CUDA see, in CUDA's order: every one where it is unset; its ids (CUDA's
    indices, or GPU UUIDs or their unique beginnings) up to the first that names none or repeats one."""
    ordered, ids = cuda_order(gpus, environ), environ.get("CUDA_VISIBLE_DEVICES")
    if ids is None:
        return ordered
    seen = []
    for id in ids.split(","):
        id = id.strip()
        number = re.match(r"^\+?\d+", id)
        match = [ordered[int(number[0])]] if number and int(number[0]) < len(ordered) else \
            [g for g in ordered if id.startswith("GPU-") and g["uuid"].startswith(id)]
        if len(match) != 1 or match[0] in seen:
            break
        seen.append(match[0])
    return seen


def runs_on(build, driver):
    """Whether a torch CUDA build ("12.8"; None: a CPU or ROCm build) runs on this driver."""
    if build is None or driver in (None, "mismatch"):
        return False
    floor = FLOORS.get(build.split(".")[0])
    return floor is not None and version(driver) >= floor


def stand_in(monkeypatch, description, sees="all", build=None):
    """This machine, in a test's process: HOOK_GPU_MACHINE for nvidia-smi, and torch.cuda's answers, asked again at
    each call, so that CUDA_VISIBLE_DEVICES set later counts. `sees`: "all" (torch sees what CUDA_VISIBLE_DEVICES
    shows) or "none" (a broken machine: torch counts none); `build`: torch's build ("12.8", "cpu", "rocm";
    torch.version.cuda, torch.version.hip and torch.__version__), by default this torch's own. Before CUDA starts a
    CUDA build counts the GPUs the driver lists (NVML, as once Lightning is imported); CUDA starts only where the
    build runs on the driver (else torch's own words, raised), then counts as CUDA does (one MIG instance) and runs
    torch's own checks of the build's kernels against each GPU, which warn in torch's words."""
    import torch

    monkeypatch.setenv(SETTING, description)
    if build is not None:
        cuda = None if build in ("cpu", "rocm") else build
        suffix = {"cpu": "+cpu", "rocm": "+rocm6.4"}.get(build, f"+cu{build.replace('.', '')}")
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.version, "hip", "6.4.43484" if build == "rocm" else None)
        monkeypatch.setattr(torch, "__version__", type(torch.__version__)(torch.__version__.split("+")[0] + suffix))
    found = machine(description)
    started = []

    def kind():
        return "rocm" if torch.version.hip else torch.version.cuda

    def listed():  # what the driver lists (NVML's count, which honours CUDA_VISIBLE_DEVICES as torch reads it)
        if sees == "none" or kind() is None or found["driver"] == "mismatch":
            return []
        if kind() == "rocm":
            return visible(found["gpus"], os.environ) if found["rocm"] else []
        return [] if found["rocm"] else visible([g for g in found["gpus"] if g["listed"]], os.environ)

    def counted():  # before CUDA starts, the driver's list; after, CUDA's own count (a MIG instance of the first)
        gpus = listed()
        if found["driver"] == "mismatch" and kind() not in (None, "rocm"):  # NVML fails: torch asks CUDA, which fails
            import warnings
            warnings.warn(DEVICE_COUNT_ERROR)
        return gpus[:1] if started and found["mig"] else gpus

    def gpu(device=None):
        index = getattr(device, "index", device)
        index = int(str(index).rsplit(":", 1)[-1]) if index not in (None, "cuda") else 0
        return counted()[index]

    def properties(device=None):
        g = gpu(device)
        major, minor = version(g["cap"])[:2]
        return types.SimpleNamespace(name=g["name"], total_memory=g["memory"] * 2**20, major=major, minor=minor,
                                     uuid=g["uuid"].removeprefix("GPU-"), multi_processor_count=132)

    def init():
        if not listed():
            raise RuntimeError("No CUDA GPUs are available")
        if kind() != "rocm" and not runs_on(kind(), found["driver"]):
            cuda = DRIVER_CUDA[max(b for b in DRIVER_CUDA if b <= version(found["driver"])[0])].split(".")
            raise RuntimeError(TOO_OLD.format(found=int(cuda[0]) * 1000 + int(cuda[1]) * 10))
        started.append(True)
        # torch's own checks, which its CUDA start runs (torch.cuda._lazy_init runs the calls queued at import),
        # with this machine's answers: its words where the build has no kernels for a GPU
        torch.cuda._check_capability()
        torch.cuda._check_cubins()

    def archs():
        return ARCHS.get(kind() or "", []) if kind() else []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(counted()))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(counted()))
    monkeypatch.setattr(torch.cuda, "init", init)
    monkeypatch.setattr(torch.cuda, "get_arch_list", archs)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu(device)["name"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: version(gpu(device)["cap"])[:2])
    def bf16_supported(including_emulation=True):  # torch's: ROCm's yes, else the GPU's, once CUDA starts
        if kind() == "rocm":
            return True
        if not counted():
            return False
        if not started:
            init()  # torch.cuda.current_device() starts CUDA: torch's own words where it cannot
        return version(gpu()["cap"]) >= (8,)

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported)
    return found


def main():
    out, code = answer(sys.argv[1:])
    print(out)
    return code


if __name__ == "__main__":
    sys.exit(main())
