# every script imports nanorl: from then on bad input ends it in one line (nanorl/errors.py)
from nanorl.errors import install_excepthook

install_excepthook()
