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

import lightning as L  # [03] new
import torch
import torch.nn.functional as F
import torchmetrics
from watermark import watermark

import parallelize  # [06] new: FSDP2, shard by shard
from local_utilities import build_vit
from local_utilities import evaluate
from local_utilities import get_dataloaders
from local_utilities import lesson_parser
from run_keeping.keeper import RunKeeper


def train(num_epochs, model, optimizer, train_loader, val_loader, device, keeper, fabric):  # [03] instead of (..., keeper): the loop calls fabric
    start = time.time()
    for epoch in range(keeper.start_epoch, num_epochs):
        train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10).to(device)

        model.train()
        for batch_idx, (features, targets) in enumerate(train_loader):
            model.train()  # the talk's: undoes model.eval() below; changes nothing in this ViT (dropout 0, no batch norm)

            ### FORWARD AND BACK PROP
            logits = model(features)
            loss = F.cross_entropy(logits, targets)

            optimizer.zero_grad()
            fabric.backward(loss)  # [03] instead of loss.backward()

            ### UPDATE MODEL PARAMETERS
            optimizer.step()
            keeper.batch_done(loss, len(targets))  # times the step for the record; a loss not finite, checked where the loop prints and as the epoch ends, stops the run

            ### LOGGING
            if not batch_idx % 300:  # the talk's; RunKeeper checks the loss on the same batches (keeper.py's PRINT_EVERY)
                fabric.print(f"Epoch: {epoch+1:04d}/{num_epochs:04d} | Batch {batch_idx:04d}/{len(train_loader):04d} | Loss: {loss:.4f}")  # [03] instead of print: once per machine

            model.eval()
            with torch.no_grad():
                predicted_labels = torch.argmax(logits, 1)
                train_acc.update(predicted_labels, targets)

        ### MORE LOGGING
        val_acc = evaluate(model, val_loader, device)
        fabric.print(f"Epoch: {epoch+1:04d}/{num_epochs:04d} | Train acc.: {train_acc.compute()*100:.2f}% | Val acc.: {val_acc*100:.2f}%")  # [03] instead of print
        keeper.checkpoint(val_acc)  # to continue from with --resume
    return time.time() - start


if __name__ == "__main__":
    parser = lesson_parser(epochs=3, devices=4)  # [05] instead of lesson_parser(epochs=3): four devices
    args = parser.parse_args()
    with RunKeeper(args) as keeper:  # the one owner of these changes to the process, each undone as the block ends: LT_PRECISION (the precision Fabric runs), Ctrl-C's and SIGTERM's handlers, warnings filters, torch's threads (run_keeping/keeper.py's set_up), the checkpoint folder's lock (its start)
        fabric = L.Fabric(  # [03] new: Fabric runs the device, precision and processes
            accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
            precision="bf16-mixed",  # [04] new: mixed precision (32-true on a device without native bfloat16: run_keeping/device.py's precision_that_runs decides from this literal, which parse_args reads in the script's text; RunKeeper.set_up sets the result as LT_PRECISION, which Fabric uses in place of this argument)
            strategy=L.fabric.strategies.ModelParallelStrategy(parallelize.fsdp_each_encoder_block, data_parallel_size=args.world_size, tensor_parallel_size=1),  # [06] instead of "ddp": FSDP2
        )
        fabric.launch()  # [03] new: starts the other processes, if any
        keeper.start(fabric)  # [03] instead of keeper.start(): in each of Fabric's processes
        device = fabric.device  # [03] instead of torch.device(args.accelerator)
        fabric.print(watermark(packages="torch,torchvision,lightning", python=True))  # [03] instead of print: once per machine
        torch.manual_seed(args.seed)

        ##########################
        ### 1 Loading the Dataset
        ##########################
        with fabric.rank_zero_first(local=True):  # [03] new: one process per machine downloads, the others wait
            train_loader, val_loader, test_loader = get_dataloaders(args)
        train_loader, val_loader, test_loader = fabric.setup_dataloaders(train_loader, val_loader, test_loader)  # [03] new: each batch now arrives on the device, so the loop drops its .to(device)

        #########################################
        ### 2 Initializing the Model
        #########################################
        model = build_vit(weights="IMAGENET1K_V1", args=args)  # [01] instead of weights=None: ImageNet-pretrained (--smoke: its small ViT, pretrained on printed digits)

        # replace output layer
        model.heads.head = torch.nn.Linear(in_features=model.hidden_dim, out_features=10)

        model = fabric.setup_module(model)  # [03] instead of model.to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
        optimizer = fabric.setup_optimizers(optimizer)  # [03] new

        #########################################
        ### 3 Finetuning
        #########################################
        keeper.before_training(model, optimizer, train_loader)  # what each checkpoint keeps; with --resume, restored from the last one
        train_time = train(args.epochs, model, optimizer, train_loader, val_loader, device, keeper, fabric)  # [03] instead of (..., keeper)

        #########################################
        ### 4 Evaluation
        #########################################
        test_acc = evaluate(model, test_loader, device)
        keeper.finish(train_time, test_acc, model)  # prints the time (less the checkpoint writes), memory, test accuracy; saves the model and the record
