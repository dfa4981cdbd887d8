"""One chapter of the CVPR 2023 talk "Scaling PyTorch Model Training With Minimal Code Changes":
torchvision's ViT-B/16 trained on CIFAR-10. Each numbered script adds one technique to the one
before it: `diff` two neighbours to see it; `--help` says which. The comment of a line a lesson
changed begins with that lesson's number: `[03] instead of ...`, `[04] new: ...`. The talk's
figures are in lessons.csv.

    python THIS_SCRIPT.py            # a GPU machine: the talk's run (downloads CIFAR-10, weights)
    python THIS_SCRIPT.py --smoke    # the offline demo: a small ViT on 8x8 digits, on a CPU

Data, model and evaluation are in local_utilities.py; the flags, records, checkpoints, --resume
and Ctrl-C in run_keeping/, out of the lesson's way.
"""
import time

import torch
import torch.nn.functional as F
import torchmetrics
from watermark import watermark

from local_utilities import build_vit
from local_utilities import evaluate
from local_utilities import get_dataloaders
from local_utilities import lesson_parser
from run_keeping.keeper import RunKeeper


def train(num_epochs, model, optimizer, train_loader, val_loader, device, keeper):
    start = time.time()
    for epoch in range(keeper.start_epoch, num_epochs):
        train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10).to(device)

        model.train()
        for batch_idx, (features, targets) in enumerate(train_loader):
            model.train()  # the talk's: undoes model.eval() below; changes nothing in this ViT (dropout 0, no batch norm)
            features, targets = features.to(device), targets.to(device)

            ### FORWARD AND BACK PROP
            logits = model(features)
            loss = F.cross_entropy(logits, targets)

            optimizer.zero_grad()
            loss.backward()

            ### UPDATE MODEL PARAMETERS
            optimizer.step()
            keeper.batch_done(loss, len(targets))  # times the step for the record; a loss not finite, checked where the loop prints and as the epoch ends, stops the run

            ### LOGGING
            if not batch_idx % 300:  # the talk's; RunKeeper checks the loss on the same batches (keeper.py's PRINT_EVERY)
                print(f"Epoch: {epoch+1:04d}/{num_epochs:04d} | Batch {batch_idx:04d}/{len(train_loader):04d} | Loss: {loss:.4f}")

            model.eval()
            with torch.no_grad():
                predicted_labels = torch.argmax(logits, 1)
                train_acc.update(predicted_labels, targets)

        ### MORE LOGGING
        val_acc = evaluate(model, val_loader, device)
        print(f"Epoch: {epoch+1:04d}/{num_epochs:04d} | Train acc.: {train_acc.compute()*100:.2f}% | Val acc.: {val_acc*100:.2f}%")
        keeper.checkpoint(val_acc)  # to continue from with --resume
    return time.time() - start


if __name__ == "__main__":
    parser = lesson_parser(epochs=3)  # [01] instead of 10: finetuning needs fewer epochs
    args = parser.parse_args()
    with RunKeeper(args) as keeper:  # the one owner of these changes to the process, each undone as the block ends: LT_PRECISION (the precision Fabric runs), Ctrl-C's and SIGTERM's handlers, warnings filters, torch's threads (run_keeping/keeper.py's set_up), the checkpoint folder's lock (its start)
        keeper.start()  # takes the checkpoint folder and says how the run started
        device = torch.device(args.accelerator)
        print(watermark(packages="torch,torchvision,lightning", python=True))
        torch.manual_seed(args.seed)

        ##########################
        ### 1 Loading the Dataset
        ##########################
        train_loader, val_loader, test_loader = get_dataloaders(args)

        #########################################
        ### 2 Initializing the Model
        #########################################
        model = build_vit(weights="IMAGENET1K_V1", args=args)  # [01] instead of weights=None: ImageNet-pretrained (--smoke: its small ViT, pretrained on printed digits)

        # replace output layer
        model.heads.head = torch.nn.Linear(in_features=model.hidden_dim, out_features=10)

        model.to(device)
        model = torch.compile(model)  # [02] new: compiled on the first batches; the same maths
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)

        #########################################
        ### 3 Finetuning
        #########################################
        keeper.before_training(model, optimizer, train_loader)  # what each checkpoint keeps; with --resume, restored from the last one
        train_time = train(args.epochs, model, optimizer, train_loader, val_loader, device, keeper)

        #########################################
        ### 4 Evaluation
        #########################################
        test_acc = evaluate(model, test_loader, device)
        keeper.finish(train_time, test_acc, model)  # prints the time (less the checkpoint writes), memory, test accuracy; saves the model and the record
