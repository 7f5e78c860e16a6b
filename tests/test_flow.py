import math

import torch

from models.rectified_flow import draw_sample_noise, euler_sample, interpolate, shift_sigmas, training_sigmas


def test_interpolation_endpoints_and_target():
    x0, noise = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    assert torch.equal(interpolate(x0, noise, torch.zeros(3)), x0)
    assert torch.equal(interpolate(x0, noise, torch.ones(3)), noise)
    sigma = torch.tensor([0.2, 0.5, 0.9])
    eps = 1e-3  # d x_t / d sigma is the velocity target noise - x0
    slope = (interpolate(x0, noise, sigma + eps) - interpolate(x0, noise, sigma)) / eps
    torch.testing.assert_close(slope, noise - x0, rtol=1e-3, atol=1e-3)


def test_shift():
    sigma = torch.linspace(0, 1, 11)
    assert torch.equal(shift_sigmas(sigma, 1.0), sigma)
    shifted = shift_sigmas(sigma, 3.0)
    torch.testing.assert_close(shifted, 3 * sigma / (1 + 2 * sigma))
    assert shifted[0] == 0 and shifted[-1] == 1 and (shifted[1:-1] > sigma[1:-1]).all()


def test_noise_is_keyed_by_seed_step_and_position_only():
    whole = draw_sample_noise(7, 3, torch.arange(8), (2, 4, 4))
    part = draw_sample_noise(7, 3, torch.tensor([5, 6]), (2, 4, 4))
    assert torch.equal(whole.noise[5:7], part.noise)
    assert torch.equal(whole.sigma_normal[5:7], part.sigma_normal)
    assert torch.equal(whole.dropout_uniform[5:7], part.dropout_uniform)
    torch.manual_seed(123)  # the process RNG plays no part
    assert torch.equal(draw_sample_noise(7, 3, torch.arange(8), (2, 4, 4)).noise, whole.noise)
    assert not torch.equal(draw_sample_noise(7, 4, torch.arange(8), (2, 4, 4)).noise, whole.noise)
    assert not torch.equal(draw_sample_noise(8, 3, torch.arange(8), (2, 4, 4)).noise, whole.noise)


def test_sigma_sampling():
    draws = draw_sample_noise(0, 0, torch.arange(4000), (1,))
    logit = training_sigmas(draws, "logit_normal", 0.0, 1.0, 1.0)
    assert 0 < logit.min() and logit.max() < 1
    assert abs(logit.mean() - 0.5) < 0.02 and abs(torch.logit(logit).std() - 1.0) < 0.05
    uniform = training_sigmas(draws, "uniform", 0.0, 1.0, 1.0)
    assert abs(uniform.mean() - 0.5) < 0.02 and abs(uniform.var() - 1 / 12) < 0.005
    assert training_sigmas(draws, "logit_normal", 1.0, 1.0, 1.0).mean() > logit.mean()


def test_euler_with_exact_velocity_recovers_the_data():
    target = torch.randn(2, 3, 4, 4)
    noise = torch.randn(2, 3, 4, 4)

    def velocity(x, sigma, text):  # exact v for a point mass at `target`
        return (x - target) / sigma.view(-1, 1, 1, 1)

    empty = {"prompt_embeds": torch.zeros(2, 1, 1)}
    out = euler_sample(velocity, noise, empty, empty, steps=7, cfg_scale=1.0, shift=3.0)
    torch.testing.assert_close(out, target, rtol=1e-5, atol=1e-5)


def test_classifier_free_guidance_combines_branches():
    cond, uncond = {"prompt_embeds": torch.ones(1, 1, 1)}, {"prompt_embeds": torch.zeros(1, 1, 1)}

    def velocity(x, sigma, text):  # conditional branch says 1, unconditional says 0
        return text["prompt_embeds"].view(-1, 1, 1, 1).expand_as(x)

    out = euler_sample(velocity, torch.zeros(1, 1, 2, 2), cond, uncond, steps=4, cfg_scale=3.0, shift=1.0)
    torch.testing.assert_close(out, torch.full((1, 1, 2, 2), -3.0))  # x moves by -(1) * (0 + 3 * (1 - 0))


def test_mode_and_cosmap_sampling_have_the_sd3_densities():
    """Mode sampling with s > 0 moves mass from the ends to the middle; cosmap's density is
    2 / (pi (1 - 2t + 2t^2)) (SD3 paper, sec. 3.1). Both are symmetric around 1/2 and stay in [0, 1]."""
    draws = draw_sample_noise(0, 0, torch.arange(20000), (1,))
    uniform = training_sigmas(draws, "uniform", 0.0, 1.0, 1.0)
    mode = training_sigmas(draws, "mode", 0.0, 1.0, 1.0, mode_scale=1.29)
    ends = lambda s: ((s < 0.1) | (s > 0.9)).float().mean()  # noqa: E731
    assert ends(mode) < 0.6 * ends(uniform) and abs(mode.mean() - 0.5) < 0.01
    mode_zero = training_sigmas(draws, "mode", 0.0, 1.0, 1.0, mode_scale=0.0)
    torch.testing.assert_close(mode_zero, 1 - draws.sigma_uniform)  # s = 0: 1 - u, uniform again
    cosmap = training_sigmas(draws, "cosmap", 0.0, 1.0, 1.0)
    assert cosmap.min() >= 0 and cosmap.max() <= 1 and abs(cosmap.mean() - 0.5) < 0.01
    counts = torch.histc(cosmap, bins=10, min=0, max=1) / len(cosmap)
    centres = torch.arange(10) / 10 + 0.05
    density = 2 / (math.pi * (1 - 2 * centres + 2 * centres**2))
    torch.testing.assert_close(counts, density / 10, rtol=0.1, atol=0.005)
    shifted = training_sigmas(draws, "cosmap", 0.0, 1.0, 3.0)
    assert shifted.median() > cosmap.median()  # the shift applies to every scheme


def test_fluxs_resolution_shift_is_its_pipelines_schedule():
    """FLUX.1's shift by image size: e^mu, mu 0.5 at 256 tokens and 1.15 at 4096; Euler's sigmas on it are those
    of FluxPipeline's scheduler (dynamic shifting, mu from calculate_shift) for the same token count."""
    import pytest
    from models.rectified_flow import resolution_shift
    diffusers = pytest.importorskip("diffusers")
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    assert resolution_shift(256) == pytest.approx(math.exp(0.5)) and resolution_shift(4096) == pytest.approx(math.exp(1.15))
    for tokens, steps in ((1024, 28), (4096, 4), (64, 10)):
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                              base_image_seq_len=256, max_image_seq_len=4096)
        scheduler.set_timesteps(sigmas=[1 - i / steps for i in range(steps)], mu=calculate_shift(tokens))
        ours = shift_sigmas(torch.linspace(1.0, 0.0, steps + 1), resolution_shift(tokens))
        torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-5, atol=1e-6)
