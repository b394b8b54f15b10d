"""Rewards: rule scorers (math, countdown, deep-research QA), custom-function loading, routing by
data_source, the reward manager that turns a batch of responses into token-level scores, and the extras a
scorer returns besides its score (rewards/extras.py).

Kept free of imports so that the math-verify worker process (``archer.rewards.math_worker``) starts fast.
"""
