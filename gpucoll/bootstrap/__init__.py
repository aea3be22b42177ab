"""Bootstrap: find out who this process is (``detect_launch``) and meet the other ranks (``TCPStore``)."""

from gpucoll.bootstrap.env import LaunchInfo, detect_launch
from gpucoll.bootstrap.store import TCPStore

__all__ = ["LaunchInfo", "TCPStore", "detect_launch"]
