"""Reinforcement learning on rollouts (``train_mode: grpo``): advantages from a group's rewards
(:mod:`megacann.rl.advantages`), the reward registry (:mod:`megacann.rl.rewards`), and, in the loop's
modules, rollouts and prompts. The policy objective itself is a model-side loss beside DPO's,
:mod:`megacann.models.policy_loss`."""
