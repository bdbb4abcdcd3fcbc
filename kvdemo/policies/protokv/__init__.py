"""ProtoKV (paper 003) as a package, one room per concern:

- :mod:`.policy`: the policy (Alg. 1-4 orchestrated over every layer and KV head at once, its report);
- :mod:`.split`: how ``M`` splits into the near window and the bank (Table 5, and the near window's two chunks);
- :mod:`.views`: its views as plain data (prototype assignments, the bank);
- :mod:`.gathering`: what the pass reads of the memory (the near window, the evicted tokens un-rotated), every
  layer of a stack at once;
- :mod:`.assignment`: Eq. 1, the cost of each prototype for an evicted token and the cheapest per token;
- :mod:`.bank`: the prototype bank and the operations that keep its records (seeding, seeds in the near window,
  aging, recycling, the churn, the assignment record the views read);
- :mod:`.absorption`: Alg. 1 lines 8-13, a chunk's assigned tokens into their prototypes and residuals;
- :mod:`.merging`: Alg. 2's merging (each prototype's close partner, and the fold into it);
- :mod:`.synthesis`: Alg. 3-4, the pseudo-tokens and bias the memory's summary region holds;
- :mod:`.pq`: product quantisation of residuals (codebooks, encode/decode, Alg. 3's beam search);
- :mod:`.ema`: running statistics (closed-form EMA over a chunk, running means, the spatial Mahalanobis distance).
"""

from .bank import ProtoBank
from .policy import REASON_NAMES, REASON_NEAR, ProtoKV

__all__ = ["REASON_NAMES", "REASON_NEAR", "ProtoBank", "ProtoKV"]
