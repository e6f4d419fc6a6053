"""ofl errors as Python exceptions."""
from . import _lib


class OflError(RuntimeError):
    """An ofl call failed. ``status`` is the ofl_status_t code, ``status_str``
    its ofl_status_str() name and ``message`` ofl_last_error() at the time."""

    def __init__(self, status, message, where=""):
        self.status = int(status)
        self.status_str = _lib.lib.ofl_status_str(self.status).decode()
        self.message = message
        self.where = where
        text = "%s: %s" % (where, self.status_str) if where else self.status_str
        if message:
            text += ": " + message
        super().__init__(text)


def error(status, where=""):
    msg = _lib.lib.ofl_last_error()
    return OflError(status, msg.decode(errors="replace") if msg else "", where)


def check(status, where=""):
    if status != 0:
        raise error(status, where)
    return status
