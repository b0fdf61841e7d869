"""The trainer: the Jobs API (submit, watch, cancel, list) for pretrain, SFT and RL jobs run on Ray."""
