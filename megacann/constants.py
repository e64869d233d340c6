"""Values every layer of megacann agrees on, defined below all of them (no imports).

:data:`IGNORE_INDEX` marks a label that takes no loss (prompt tokens in SFT, padding, masked EOD): the
data pipeline writes it, the loss kernels and the step's target-token count skip it.
"""

IGNORE_INDEX = -100
