"""08, saving and loading: every finished training run saves its finetuned model as one file, a
plain state dict of torchvision's VisionTransformer. This loads it into a fresh ViT-B/16 with
Fabric on one device, evaluates it on the CIFAR-10 test set (the training run's "Test accuracy"
line, again), and with --predict names the class of your own images, with its probability.

    python 08_load-and-evaluate.py                    # the newest whole run's model in models/
    python 08_load-and-evaluate.py --model models/04_fabric-vit-mixed-precision.pt
    python 08_load-and-evaluate.py --predict cat.png truck.jpg
    python 08_load-and-evaluate.py --smoke            # the newest --smoke model, on the digits

The file needs no Lightning to load:
    model = torchvision.models.vit_b_16(); model.heads.head = torch.nn.Linear(768, 10)
    model.load_state_dict(torch.load("models/04_fabric-vit-mixed-precision.pt"))
"""
import glob
import os
import re

import lightning as L
import numpy as np
import torch
from PIL import Image
from PIL import UnidentifiedImageError

from local_utilities import SMOKE_IMAGE_SIZE
from local_utilities import build_vit
from local_utilities import evaluate
from local_utilities import get_dataloaders
from local_utilities import talk_transforms
from run_keeping.config import MOST_WORKERS
from run_keeping.config import Parser
from run_keeping.config import check_path
from run_keeping.config import fail
from run_keeping.config import whole_number
from run_keeping.reading import load_model_file
from run_keeping.reading import record_of
from run_keeping.reading import tool_run
from run_keeping.reading import whole

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")  # what the runs record
NOISE_IMAGES = 32  # random pictures: the model's answer is no surer than its surest on these? it cannot tell


def parse_args():
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="PATH", help="a model file (default: the newest in models/ "
                        "of a whole run: one cut short by --max-steps is passed over)")
    parser.add_argument("--predict", nargs="+", metavar="IMAGE", help="PNG or JPEG files, any "
                        "size; with --smoke, one digit each, read as scikit-learn's digits look "
                        "(light on dark, centred, filling the frame; a light background is inverted). "
                        "Each answer comes with its probability; one no surer than the model is of "
                        f"{NOISE_IMAGES} pictures of random noise says it cannot tell")
    parser.add_argument("--smoke", action="store_true", help="a --smoke run's model, on the digits")
    parser.add_argument("--data-dir", default="data", metavar="DIR", help="where CIFAR-10 is, or goes")
    parser.add_argument("--no-download", action="store_true", help="fail instead of downloading CIFAR-10")
    parser.add_argument("--num-workers", type=whole_number(0, MOST_WORKERS), default=4, metavar="N",
                        help="data loader processes")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="default: the training run's, from --results; else 32-true")
    parser.add_argument("--results", default="results/runs.jsonl", metavar="FILE", help="run records")
    args = parser.parse_args()
    for path in args.predict or []:  # the images first: a typo should not wait for the model
        try:
            with Image.open(path) as image:
                image.verify()
        except (OSError, UnidentifiedImageError) as err:
            fail(f"cannot read the image {path}: {getattr(err, 'strerror', None) or err}")
    if args.model and not os.path.isfile(args.model):
        fail(f"--model {args.model}: " + ("it is a folder, not a model file" if os.path.isdir(args.model)
                                          else "no such file (a finished training run writes one: see its --save-model)"))
    if os.path.isdir(args.results) or not os.path.isdir(os.path.dirname(os.path.abspath(args.results))) \
            and os.path.exists(os.path.dirname(os.path.abspath(args.results))):
        fail(f"--results {args.results} cannot be read: it is a folder, or under a file, not a file of run records")
    if not args.predict and not args.smoke:
        if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):
            fail(f"--data-dir {args.data_dir} is a file, not a folder: give the folder CIFAR-10 is in")
        if not args.no_download:
            check_path("--data-dir", args.data_dir, folder=True)
    args.model = args.model or newest_model(args)
    # the settings get_dataloaders needs, for the test set only
    args.synthetic, args.max_steps, args.seed = False, None, 123
    args.batch_size, args.micro_batches, args.data_parallel = 16, 1, 1
    return args


def newest_model(args):
    """The newest model file in models/ of the asked kind (--smoke or full) from a whole run: a
    run cut short by --max-steps (by its record, or its name) is a debugging run, not a result."""
    kinds, cut_short = {}, []
    for path in glob.glob("models/*.pt"):
        record = record_of(path, args.results)
        kind = record["kind"] if record else (re.findall(r"-(smoke-synthetic|smoke|synthetic)(?=-|$)",
                                                         os.path.basename(path)[:-3]) or ["full"])[0]
        result = whole(record) if record else "-max-steps" not in os.path.basename(path)
        (kinds.setdefault(kind, []) if result else cut_short).append(path)
    models = kinds.get("smoke" if args.smoke else "full", [])
    if not models:
        also = (f" Only --smoke models are there ({', '.join(sorted(kinds['smoke']))}): add --smoke "
                "to use the newest." if kinds.get("smoke") and not args.smoke else "")
        passed = f" Passed over, as cut short by --max-steps: {', '.join(sorted(cut_short))}." if cut_short else ""
        fail(f"no {'--smoke ' if args.smoke else ''}model of a whole run in models/ (training runs save "
             f"one when they finish): give --model PATH.{also}{passed}")
    return max(models, key=os.path.getmtime)


def as_smoke_digit(image):
    """A picture of one digit (a PIL image) as the smoke data look, for 08 --predict: grey, light
    ink on a dark ground (a light ground is inverted). A digit that already fills its frame from
    edge to edge, as the handwritten set's do, is only resized to 32x32; any other is cropped to
    its ink, padded to a square and reduced to scikit-learn's 8x8 grid of 17 levels first.
    Returns (3 x 32 x 32 tensor, whether it was inverted)."""
    interpolate = torch.nn.functional.interpolate
    gray = torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32) / 255)
    border = torch.cat([gray[0], gray[-1], gray[:, 0], gray[:, -1]])
    inverted = bool(border.median() > 0.5)
    if inverted:
        gray, border = 1 - gray, 1 - border
    ink = (gray - border.median()).clamp(min=0)
    ink = ink / ink.max().clamp(min=1e-6)
    rows, cols = torch.nonzero(ink > 0.25, as_tuple=True)
    (height, width), span = ink.shape, lambda i, n: len(i) and i.min() <= 0.05 * n and i.max() >= 0.95 * n - 1
    if span(rows, height) or span(cols, width):
        square = interpolate(ink[None, None], size=(SMOKE_IMAGE_SIZE,) * 2, mode="bilinear",
                             align_corners=False, antialias=True)
        return square.clamp(0, 1)[0].repeat(3, 1, 1), inverted
    if len(rows):
        ink = ink[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    side = max(ink.shape)
    square = torch.zeros(side, side)
    top, left = (side - ink.shape[0]) // 2, (side - ink.shape[1]) // 2
    square[top:top + ink.shape[0], left:left + ink.shape[1]] = ink
    grid = (interpolate(square[None, None], size=(8, 8), mode="area") * 16).round() / 16
    image = interpolate(grid, size=(SMOKE_IMAGE_SIZE,) * 2, mode="bilinear", align_corners=False)
    return image.clamp(0, 1)[0].repeat(3, 1, 1), inverted


def prepare(picture, smoke):
    """A PIL picture as the model reads it, and whether its light background was inverted."""
    return as_smoke_digit(picture) if smoke else (talk_transforms()(picture.convert("RGB")), False)


def probabilities(model, image, device):
    with torch.no_grad():
        return torch.softmax(model(image.unsqueeze(0).to(device)).float(), 1)[0].cpu()


def noise_level(model, smoke, device):
    """The highest probability the model gives any class of pictures of random noise, prepared as
    yours are: an answer no surer than that, it cannot tell from a picture of nothing."""
    rng = np.random.RandomState(0)
    return max(float(probabilities(model, prepare(Image.fromarray(rng.randint(0, 256, (64, 64, 3), dtype=np.uint8)),
                                                  smoke)[0], device).max()) for _ in range(NOISE_IMAGES))


def answer(probs, classes, blank, noise):
    """What the model reads in one image, with its probability, or that it cannot tell."""
    if blank:
        return "no digit: the image is blank"
    p, label = probs.max(0)
    if p <= noise:
        return f"cannot tell: its best guess, {classes[label]}, has {p:.0%}, no more than random noise gets (up to {noise:.0%})"
    return f"{classes[label]} ({p:.0%})"


if __name__ == "__main__":
    with tool_run():  # Ctrl-C and SIGTERM: one line; the interpreter as found afterwards
        args = parse_args()
        record = record_of(args.model, args.results)  # the run that saved the model, if recorded
        precision = args.precision or (record["precision"] if record else "32-true")
        fabric = L.Fabric(accelerator="cpu" if args.smoke else args.accelerator, devices=1, precision=precision)
        print(f"Loading {args.model} on {fabric.device} in {precision}"
              + (f" (saved by {record['script']}, test accuracy {record['test_acc'] * 100:.2f}%)" if record and record["test_acc"] is not None else "")
              + ("; it was compiled then and runs eagerly now, whose rounding may change a few predictions" if record and record["compile_mode"] else ""))

        #########################################
        ### 1 Loading the model
        #########################################
        model = build_vit(weights=None, args=args)
        model.heads.head = torch.nn.Linear(in_features=model.hidden_dim, out_features=10)
        load_model_file(model, args.model)  # model.load_state_dict(torch.load(args.model)), with clear errors
        model = fabric.setup_module(model)

        if args.predict:
            #########################################
            ### 2 Predicting your own images
            #########################################
            classes = [str(digit) for digit in range(10)] if args.smoke else CIFAR10_CLASSES
            if args.smoke:
                print("Each image is read as the smoke digits look: light on dark (a light background is "
                      "inverted); a digit that does not fill its frame is cropped to its ink, padded to "
                      "a square and reduced to 8x8 grey levels")
            model.eval()
            noise = noise_level(model, args.smoke, fabric.device)
            for path in args.predict:
                try:
                    with Image.open(path) as picture:
                        image, inverted = prepare(picture, args.smoke)
                except (OSError, UnidentifiedImageError) as err:
                    fail(f"cannot read the image {path}: {getattr(err, 'strerror', None) or err}")
                blank = float(image.max() - image.min()) < 1e-6  # one colour: nothing drawn
                print(f"{path}: {answer(probabilities(model, image, fabric.device), classes, blank, noise)}"
                      + (" (light background, inverted)" if inverted and not blank else ""))
        else:
            #########################################
            ### 2 Evaluation on the test set
            #########################################
            _, _, test_loader = get_dataloaders(args)
            test_loader = fabric.setup_dataloaders(test_loader)
            test_acc = evaluate(model, test_loader, fabric.device)
            print(f"Test accuracy {test_acc * 100:.2f}%")
