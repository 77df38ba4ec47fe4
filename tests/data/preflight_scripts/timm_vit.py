"""Image classifiers as their training scripts build them: a timm model from its builder (drop-path rates
computed with .item() at build), channels_last, and torchvision's VisionTransformer; bf16 autocast, SGD with
momentum, a label-smoothing loss, metrics with .item()."""
import argparse

import timm
import torch
import torchvision

p = argparse.ArgumentParser()
p.add_argument("--model", default="vit_tiny_patch16_224")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--img", type=int, default=224)
p.add_argument("--torchvision", action="store_true")
a = p.parse_args()

if a.torchvision:
    model = torchvision.models.VisionTransformer(image_size=a.img, patch_size=16, num_layers=4, num_heads=3,
                                                 hidden_dim=192, mlp_dim=768, num_classes=100)
else:
    model = timm.create_model(a.model, pretrained=False, num_classes=100, drop_path_rate=0.1, img_size=a.img)
model = model.cuda().to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
for step in range(100):
    x = torch.randn(a.batch, 3, a.img, a.img).cuda(non_blocking=True).to(memory_format=torch.channels_last)
    y = torch.randint(0, 100, (a.batch,)).cuda(non_blocking=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
        loss = loss_fn(out, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    top1 = (out.argmax(1) == y).float().mean().item() * 100
    print(f"{step}: loss {loss.item():.3f} top1 {top1:.1f}")
