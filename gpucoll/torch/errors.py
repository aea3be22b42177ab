"""gpucoll's errors as torch.distributed raises them: torch's types and gpucoll's at once.

torch's own distributed errors (``DistBackendError``, ``DistNetworkError``, ``DistStoreError``) derive from
``RuntimeError``, and code written for gloo or NCCL catches those; gpucoll's derive from ``ValueError``,
``TimeoutError`` (an ``OSError``) and others. So every gpucoll error that leaves the "gpucoll" process group (a method
torch calls, a Work's ``wait()`` and the error it keeps) is re-typed to its twin here, a class that derives from both the gpucoll
class and ``torch.distributed.DistBackendError``: a timeout is caught by ``except dist.DistBackendError``, ``except
RuntimeError`` and ``except gpucoll.CollectiveTimeout`` alike. The twin of ``gpucoll.errors.X`` is
``gpucoll.torch.errors.X`` and shows as that in a traceback.

Only the object's class changes: its message, fields, traceback, cause and notes stay. A twin pickles as its gpucoll
class and becomes the twin again when unpickled (which imports torch).
"""

from __future__ import annotations

import functools
import inspect

import torch.distributed as dist

from gpucoll import errors

__all__ = ["raise_torch_errors_from", "raises_torch_errors", "torch_error"]

_TWINS: dict = {}  # gpucoll error class -> its twin (subclasses such as the store's SecretRefused made on demand)


def _rebuild_twin(cls, message, call, location, ranks, state):
    return torch_error(errors._rebuild(cls, message, call, location, ranks, state))


def _reduce_twin(self):
    return (_rebuild_twin, (self._gpucoll_class, self.message, self.call, self.location, self.ranks, self.__dict__))


def _twin(cls):
    twin = _TWINS.get(cls)
    if twin is None:
        twin = type(cls.__name__, (cls, dist.DistBackendError), {
            "__module__": __name__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
            "_gpucoll_class": cls, "__reduce__": _reduce_twin})
        _TWINS[cls] = twin
    return twin


# gpucoll.torch.errors.X for every class of gpucoll.errors (this module's names shadow gpucoll.errors' and one builtin,
# SystemError: the code here names gpucoll's classes through `errors.` only).
for _name in errors.__all__:
    _cls = getattr(errors, _name)
    if isinstance(_cls, type) and issubclass(_cls, errors.GpucollError):
        globals()[_name] = _twin(_cls)
del _name, _cls


def torch_error(exc):
    """`exc` itself (an exception, or None), re-typed to its twin when it is a gpucoll error."""
    if isinstance(exc, errors.GpucollError) and not isinstance(exc, dist.DistBackendError):
        exc.__class__ = _twin(type(exc))
    return exc


def translates_itself(fn):
    """Marks a method that re-types its gpucoll errors itself (`except GpucollError as e: torch_error(e)`), so that
    raise_torch_errors_from leaves it unwrapped: the wrapper's frame is a tenth of dist.all_reduce's one-call path."""
    fn._translates_itself = True
    return fn


def raises_torch_errors(fn):
    """`fn` raising the twins of the gpucoll errors it raises (the same objects, re-typed)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except errors.GpucollError as e:
            torch_error(e)
            raise

    return call


def raise_torch_errors_from(cls, private=()) -> None:
    """Makes the methods torch may call on `cls` raise the twins: the public ones that gpucoll's classes define, and
    the `private` names."""
    names = set(private)
    for klass in cls.__mro__:
        if klass.__module__.startswith("gpucoll."):
            names.update(name for name, value in vars(klass).items()
                         if not name.startswith("_") and inspect.isfunction(value))
    for name in sorted(names):
        fn = getattr(cls, name)
        if not getattr(fn, "_translates_itself", False):
            setattr(cls, name, raises_torch_errors(fn))
