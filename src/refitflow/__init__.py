"""refitflow: stream new policy weights from trainer ranks into running inference servers.

Publish a version on the trainer, refit it on the inference ranks; each rank commits
transactionally (nothing half-updated is ever served). See README.md and docs/architecture.md.
"""

from refitflow.api.publisher import Publisher, Sharded
from refitflow.api.receiver import Receiver, ReceiverStatus, RefitResult, StageStats
from refitflow.core.errors import (
    AlreadyCommittedError,
    AuthenticationError,
    ConfigError,
    CoverageError,
    FencedError,
    FrameError,
    IntegrityError,
    ManifestError,
    OutOfStepError,
    PlanError,
    RefitError,
    RefitTimeoutError,
    RoleError,
    TransportError,
    VersionError,
)
from refitflow.core.types import Identity, Manifest, Publication, ShardSpec, SourceAddress
from refitflow.engine.agent import EngineAgent
from refitflow.engine.controller import Controller, EngineResult, RankReport
from refitflow.engine.gloo_vote import GlooVote
from refitflow.engine.member import EngineMember, EngineOutcome
from refitflow.engine.readiness import EngineState
from refitflow.engine.vote import Ballot, Decision, Verdict, VoteChannel
from refitflow.engine.zmq_vote import ZmqVote
from refitflow.push.group import StreamGroup, stream_group
from refitflow.push.receiver import StreamReceiver
from refitflow.push.sender import StreamSender
from refitflow.refit.budget import BudgetStatistics, ByteBudget
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode
from refitflow.refit.fence import Fence, FenceState
from refitflow.registry.client.client import RegistryClient
from refitflow.registry.keys import DeploymentKeys, find_keys
from refitflow.registry.limits import RegistryLimits
from refitflow.registry.release import ReleasePolicy
from refitflow.registry.security import ClientSecurity, ServerSecurity
from refitflow.registry.service.embedded import Registry
from refitflow.transports import LoopbackTransport, Transport

__version__ = "0.1.0"

__all__ = [
    "AlreadyCommittedError",
    "ApplyMode",
    "AuthenticationError",
    "Ballot",
    "BudgetStatistics",
    "ByteBudget",
    "ClientSecurity",
    "ConfigError",
    "Controller",
    "CoverageError",
    "Decision",
    "DeploymentKeys",
    "EngineAgent",
    "EngineMember",
    "EngineOutcome",
    "EngineResult",
    "EngineState",
    "Fence",
    "FenceState",
    "FencedError",
    "FrameError",
    "GlooVote",
    "Identity",
    "IntegrityError",
    "LoopbackTransport",
    "Manifest",
    "ManifestError",
    "OutOfStepError",
    "PlanError",
    "Publication",
    "Publisher",
    "RankReport",
    "Receiver",
    "ReceiverConfig",
    "ReceiverStatus",
    "RefitError",
    "RefitResult",
    "RefitTimeoutError",
    "Registry",
    "RegistryClient",
    "RegistryLimits",
    "ReleasePolicy",
    "RoleError",
    "ServerSecurity",
    "ShardSpec",
    "Sharded",
    "SourceAddress",
    "StageStats",
    "StreamGroup",
    "StreamReceiver",
    "StreamSender",
    "Transport",
    "TransportError",
    "Verdict",
    "VersionError",
    "VoteChannel",
    "ZmqVote",
    "__version__",
    "find_keys",
    "stream_group",
]
