"""A tiny text-to-image pipeline assembled in code, tuned the way Stable Diffusion is:
each module wrapped, ``ait.tune(call_wrapper, data)`` over the whole pipeline."""

from __future__ import annotations

import pytest
import torch

import aitune.torch as ait

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


class TinyPipeline:
    """CLIP text encoder -> two UNet denoising steps -> VAE decoder, all from small configs."""

    def __init__(self) -> None:
        self.text_encoder = transformers.CLIPTextModel(
            transformers.CLIPTextConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                vocab_size=100,
                max_position_embeddings=32,
                bos_token_id=0,
                eos_token_id=2,
                pad_token_id=1,
            )
        ).eval()
        self.unet = diffusers.UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
        ).eval()
        self.vae = diffusers.AutoencoderKL(
            block_out_channels=(32,),
            down_block_types=("DownEncoderBlock2D",),
            up_block_types=("UpDecoderBlock2D",),
            latent_channels=4,
            norm_num_groups=32,
            sample_size=16,
        ).eval()

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        text = self.text_encoder(input_ids).last_hidden_state
        g = torch.Generator().manual_seed(input_ids.shape[0])
        latents = torch.randn((input_ids.shape[0], 4, 8, 8), generator=g)
        for t in (torch.tensor(999), torch.tensor(499)):
            noise = self.unet(latents, t, encoder_hidden_states=text).sample  # reads the output's attribute
            latents = latents - 0.1 * noise
        return self.vae.decode(latents / self.vae.config.scaling_factor).sample


MODULES = ["text_encoder", "unet", "vae.decoder"]


def test_pipeline_with_each_module_wrapped(flow, tmp_path):
    strategy = flow.strategy("onnxruntime")

    def wrap(pipe: TinyPipeline) -> TinyPipeline:
        return ait.wrap(pipe, MODULES, strategy=strategy)

    def ids(batch: int, seq: int) -> torch.Tensor:
        return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(batch * seq))

    data = [ids(1, 8), ids(3, 16)]
    unseen = [ids(2, 12)]
    report = flow.round_trip(TinyPipeline, wrap, lambda pipe, x: pipe(x), data, unseen, tmp_path)
    assert sorted(m.name for m in report.modules) == sorted(MODULES)
    unet = next(m for m in report.modules if m.name == "unet")
    assert unet.graphs[0].graph["output_structure"]["type"].endswith(":UNet2DConditionOutput")
