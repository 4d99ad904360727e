"""Writes a checkpoint with ampnet 0.1.0 (fp16 on CPU, Adam, StepLR): the fixture of tests/test_compat.py.

Run with ampnet 0.1.0 importable: python make.py DIRNAME"""
import sys, numpy as np, torch
from skorch.callbacks import LRScheduler
from torch.optim.lr_scheduler import StepLR
import ampnet
from ampnet import AmpNetClassifier
from ampnet.checkpoint import Checkpoint
assert ampnet.__version__ == "0.1.0"
torch.manual_seed(0); torch.set_num_threads(1)
class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.hidden = torch.nn.Linear(20, 16); self.out = torch.nn.Linear(16, 2)
    def forward(self, X):
        return torch.softmax(self.out(torch.relu(self.hidden(X))), dim=-1)
rng = np.random.RandomState(0)
X = rng.randn(64, 20).astype(np.float32); y = (X[:, 0] > 0).astype(np.int64)
cp = Checkpoint(monitor=None, dirname=sys.argv[1])
net = AmpNetClassifier(MLP, amp_enabled=True, amp_dtype="float16", optimizer=torch.optim.Adam, lr=0.01,
                       max_epochs=2, batch_size=16, train_split=None, verbose=0,
                       grad_scaler__init_scale=1024.0, grad_scaler__growth_interval=3,
                       callbacks=[LRScheduler(StepLR, step_size=1, gamma=0.5), cp])
import warnings; warnings.simplefilter("ignore")
net.fit(X, y)
print(net.grad_scaler_.get_scale(), net.history[-1, "train_loss"])
