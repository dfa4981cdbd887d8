"""Finetune torchvision's ViT-B/16 on CIFAR-10, as in the CVPR 2023 talk "Scaling PyTorch Model
Training With Minimal Code Changes". Each numbered script adds one technique to the one before:
`diff` the two to see it. Data, flags and run records live in local_utilities.py."""
import time

import torch
import torch.nn.functional as F
import torchmetrics
from lightning import Fabric
from watermark import watermark

from local_utilities import (
    Run,
    build_vit,
    evaluate,
    fsdp_strategy,
    get_dataloaders,
    parse_args,
    supported_precision,
)


def train(num_epochs, model, optimizer, train_loader, val_loader, device, run, fabric):  # instead of (..., run)
    start = time.time()
    for epoch in run.epochs():
        train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10).to(device)

        model.train()
        for batch_idx, (features, targets) in enumerate(train_loader):
            model.train()

            ### FORWARD AND BACK PROP
            logits = model(features)
            loss = F.cross_entropy(logits, targets)

            optimizer.zero_grad()
            fabric.backward(loss)  # instead of loss.backward()

            ### UPDATE MODEL PARAMETERS
            optimizer.step()

            ### LOGGING
            run.step(epoch, batch_idx, loss, len(targets))  # stops on a NaN loss; times the step
            if not batch_idx % 300:
                run.print(f"Epoch: {epoch+1:04d}/{num_epochs:04d} | Batch {batch_idx:04d}/{len(train_loader):04d} | Loss: {loss:.4f}")

            model.eval()
            with torch.no_grad():
                predicted_labels = torch.argmax(logits, 1)
                train_acc.update(predicted_labels, targets)
            if run.max_steps_reached:
                break

        ### MORE LOGGING
        val_acc = evaluate(model, val_loader, device)
        run.print(f"Epoch: {epoch+1:04d}/{num_epochs:04d} | Train acc.: {train_acc.compute()*100:.2f}% | Val acc.: {val_acc*100:.2f}%")
        run.end_epoch(epoch, model, optimizer, val_acc, train_time_s=time.time() - start)
    return time.time() - start


if __name__ == "__main__":
    args = parse_args(epochs=3, devices=4)  # instead of devices=1: four GPUs
    fabric = Fabric(  # new: Lightning Fabric runs the accelerator, devices and processes
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
        precision=supported_precision("bf16-mixed", args),  # new: bf16 mixed precision (16-mixed where a GPU lacks bf16)
        strategy=fsdp_strategy(args),  # new: FSDP, each EncoderBlock sharded across all processes
    )
    fabric.launch()  # new: starts the other processes, if any
    device = fabric.device  # instead of torch.device(args.accelerator)
    fabric.print(watermark(packages="torch,torchvision,lightning", python=True))  # instead of print: once per machine
    torch.manual_seed(args.seed)

    ##########################
    ### 1 Loading the Dataset
    ##########################
    with fabric.rank_zero_first(local=True):  # new: one process per machine downloads, the others wait
        train_loader, val_loader, test_loader = get_dataloaders(args)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(train_loader, val_loader, test_loader)  # new

    #########################################
    ### 2 Initializing the Model
    #########################################
    model = build_vit(weights="IMAGENET1K_V1", args=args)  # instead of weights=None: ImageNet-pretrained

    # replace output layer
    model.heads.head = torch.nn.Linear(in_features=model.hidden_dim, out_features=10)

    model = fabric.setup_module(model)  # instead of model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
    optimizer = fabric.setup_optimizers(optimizer)  # new

    #########################################
    ### 3 Finetuning
    #########################################
    run = Run(args, fabric)  # instead of Run(args): checkpoints with fabric.save
    run.resume(model, optimizer, train_loader)
    elapsed = train(args.epochs, model, optimizer, train_loader, val_loader, device, run, fabric)  # instead of (..., run)

    #########################################
    ### 4 Evaluation
    #########################################
    test_acc = evaluate(model, test_loader, device)
    run.finish(elapsed, test_acc)  # prints time, memory and test accuracy; appends the record
