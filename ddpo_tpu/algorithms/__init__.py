"""The RL algorithms, a module each (ddpo, grpo, nft, awm), their interface (base) and shared pieces (ppo,
stat_tracking, guards)."""
