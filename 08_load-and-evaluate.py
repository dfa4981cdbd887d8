"""08, saving and loading: every finished training run (00-07, 09, 10) saves its finetuned model as
one file, a plain state dict of torchvision's VisionTransformer. This loads it into a fresh ViT-B/16 with
Fabric on one device, evaluates it on the CIFAR-10 test set (the training run's "Test accuracy"
line, again), and with --predict names the class of your own images.

    python 08_load-and-evaluate.py                    # the newest model in models/
    python 08_load-and-evaluate.py --model models/04_fabric-vit-mixed-precision.pt
    python 08_load-and-evaluate.py --predict cat.png truck.jpg
    python 08_load-and-evaluate.py --smoke            # the newest --smoke model, on the digits

The file needs no Lightning to load:
    model = torchvision.models.vit_b_16(); model.heads.head = torch.nn.Linear(768, 10)
    model.load_state_dict(torch.load("models/04_fabric-vit-mixed-precision.pt"))
"""
import argparse
import glob
import os

import lightning as L
import torch
from PIL import Image, UnidentifiedImageError

from local_utilities import as_smoke_digit, build_vit, evaluate, get_dataloaders, talk_transforms
from run_keeping.errors import fail
from run_keeping.files import record_of
from run_keeping.model_file import load_model_file

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="PATH", help="a model file (default: the newest in models/)")
    parser.add_argument("--predict", nargs="+", metavar="IMAGE", help="PNG or JPEG files, any "
                        "size; with --smoke, one digit each, read as scikit-learn's digits look "
                        "(light on dark, centred, filling the frame; a light background is inverted)")
    parser.add_argument("--smoke", action="store_true", help="a --smoke run's model, on the digits")
    parser.add_argument("--data-dir", default="data", metavar="DIR", help="where CIFAR-10 is, or goes")
    parser.add_argument("--no-download", action="store_true", help="fail instead of downloading CIFAR-10")
    parser.add_argument("--num-workers", type=int, default=4, metavar="N", help="data loader processes")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--precision", help="default: the training run's, from --results; else 32-true")
    parser.add_argument("--results", default="results/runs.jsonl", metavar="FILE", help="run records")
    args = parser.parse_args()
    for path in args.predict or []:  # the images first: a typo should not wait for the model
        try:
            with Image.open(path) as image:
                image.verify()
        except (OSError, UnidentifiedImageError) as err:
            fail(f"cannot read the image {path}: {getattr(err, 'strerror', None) or err}")
    if args.model is None:
        found = glob.glob("models/*.pt")
        smoke = [m for m in found if m.endswith("-smoke.pt")]
        full = [m for m in found if not m.endswith(("-smoke.pt", "-synthetic.pt"))]
        models = smoke if args.smoke else full
        if not models:
            also = (f" Only --smoke models are there ({', '.join(sorted(smoke))}): add --smoke to "
                    "use the newest." if smoke and not args.smoke else "")
            fail(f"no {'--smoke ' if args.smoke else ''}model in models/ (training runs save one "
                 f"when they finish): give --model PATH.{also}")
        args.model = max(models, key=os.path.getmtime)
    # the settings get_dataloaders needs, for the test set only
    args.synthetic, args.max_steps, args.seed = False, None, 123
    args.batch_size, args.micro_batches, args.data_parallel = 16, 1, 1
    return args


if __name__ == "__main__":
    args = parse_args()
    record = record_of(args.model, args.results)  # the run that saved the model, if recorded
    precision = args.precision or (record["precision"] if record else "32-true")
    fabric = L.Fabric(accelerator="cpu" if args.smoke else args.accelerator, devices=1, precision=precision)
    print(f"Loading {args.model} on {fabric.device} in {precision}"
          + (f" (saved by {record['script']}, test accuracy {record['test_acc'] * 100:.2f}%)" if record and record["test_acc"] is not None else "")
          + ("; it was compiled then and runs eagerly now, whose rounding may change a few predictions" if record and record.get("compiled") else ""))

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
        for path in args.predict:
            try:
                with Image.open(path) as picture:
                    image, inverted = as_smoke_digit(picture) if args.smoke else (talk_transforms()(picture.convert("RGB")), False)
            except (OSError, UnidentifiedImageError) as err:
                fail(f"cannot read the image {path}: {getattr(err, 'strerror', None) or err}")
            with torch.no_grad():
                label = torch.argmax(model(image.unsqueeze(0).to(fabric.device)), 1).item()
            print(f"{path}: {classes[label]}" + (" (light background, inverted)" if inverted else ""))
    else:
        #########################################
        ### 2 Evaluation on the test set
        #########################################
        _, _, test_loader = get_dataloaders(args)
        test_loader = fabric.setup_dataloaders(test_loader)
        test_acc = evaluate(model, test_loader, fabric.device)
        print(f"Test accuracy {test_acc * 100:.2f}%")
