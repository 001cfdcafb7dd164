"""Which executors the scheduler drives, from one of three sources chosen by `--discovery`.

- `static`: the `--executors` list, fixed for the process's life.
- `dns`: one `--executors` name (a headless Service, `name:port`) resolved every `--dns-refresh-seconds`;
  each A or AAAA record is an executor on that port.
- `kubernetes`: EndpointSlices watched through the API server (endpoint_slices.py).

Every source hands the fleet the whole set of addresses it currently sees (`Fleet.sync`); the fleet adds
the new ones and drains the ones that left. A source that cannot tell (a DNS timeout, an API server that is
down) says nothing, so the fleet keeps what it has: an executor that really died is found by its stream
breaking, not by a lookup failing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable

import dns.asyncresolver
import dns.exception
import dns.resolver

from scheduler_service.membership.addresses import host_port, join_host_port
from scheduler_service.settings import SchedulerSettings

log = logging.getLogger("stepwire.scheduler")


def resolver(nameserver: str) -> dns.asyncresolver.Resolver:
    """The pod's resolver (/etc/resolv.conf: search domains, ndots), or one name server given as host:port."""
    if not nameserver:
        return dns.asyncresolver.Resolver()
    r = dns.asyncresolver.Resolver(configure=False)
    host, port = host_port(nameserver)
    r.nameservers, r.port = [host], port
    return r


async def resolve(r: dns.asyncresolver.Resolver, name: str, port: int, lifetime: float = 5.0) -> set[str] | None:
    """Every address `name` has now, or None when the lookup failed without an answer."""
    found: set[str] = set()
    for rdtype in ("A", "AAAA"):
        try:
            answer = await r.resolve(name, rdtype, search=True, lifetime=lifetime)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue            # an authoritative "none": no ready executor, or no IPv6
        except dns.exception.DNSException as e:
            log.warning("resolving %s (%s) failed: %s; keeping the executors known", name, rdtype, e)
            return None
        found |= {join_host_port(rr.address, port) for rr in answer}
    return found


async def follow_dns(settings: SchedulerSettings, sync: Callable[[set[str]], None]) -> None:
    name, port = host_port(settings.executors[0])
    r = resolver(settings.dns_nameserver)
    seen = None
    while True:
        found = await resolve(r, name, port)
        if found is not None:
            if found != seen:
                log.info("%s resolves to %s", name, ", ".join(sorted(found)) or "nothing")
            seen = found
            sync(found)
        await asyncio.sleep(settings.dns_refresh_seconds)


def start(settings: SchedulerSettings, sync: Callable[[Iterable[str]], None]) -> asyncio.Task | None:
    """Start following the configured source; `sync` gets every new view on the event loop."""
    if settings.discovery == "static":
        sync(settings.executors)
        return None
    if settings.discovery == "dns":
        return asyncio.get_running_loop().create_task(follow_dns(settings, sync))
    from scheduler_service.membership.endpoint_slices import watch_endpoint_slices

    loop = asyncio.get_running_loop()
    # The kubernetes client blocks; its watch runs on a thread and hands each view to the loop.
    threading.Thread(target=watch_endpoint_slices, name="endpointslices", daemon=True,
                     args=(settings, lambda found: loop.call_soon_threadsafe(sync, found))).start()
    return None
