"""Speculative decoding's policy, torch-free: proposers, how many guesses a step takes, the
acceptance of verified guesses. The draft head that proposes on the device is one of the
runner's parts (engine/runner/draft_head.py): it is built from them and the runner composes it."""
