import torch

# The suite shares two cores with servers it starts; one intra-op thread avoids the
# spin-wait stalls that made tiny-model steps 5x slower under contention.
torch.set_num_threads(1)
