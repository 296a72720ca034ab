/* ddp_sock_local.c - this host's own addresses, for the address a rank
 * advertises: the one it would use to reach a given host (the store's, by
 * default) and the address of a named network interface
 * (PYDDP_SOCKET_IFNAME). Contracts in ddp_sock.h.
 */
#include <errno.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ddp_sock.h"

ddp_status ddp_sock_route_addr(const char *host, char *out, size_t outlen) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    hints.ai_flags = AI_NUMERICSERV;
    int g = getaddrinfo(host, "9", &hints, &res);
    if (g != 0)
        return ddp_error(DDP_ERR_CONNECT, "cannot resolve '%s' to find the local "
                         "address that reaches it (%s)", host, gai_strerror(g));
    int err = ENETUNREACH;
    ddp_status st = DDP_ERR_CONNECT;
    for (struct addrinfo *ai = res; ai != NULL && st != DDP_OK; ai = ai->ai_next) {
        int fd = ddp_sock_open(ai->ai_family, SOCK_DGRAM, 0);
        if (fd < 0) {
            err = errno;
            continue;
        }
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        /* connect() on UDP only picks a route and source address. */
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
            getsockname(fd, (struct sockaddr *)&ss, &len) == 0 &&
            getnameinfo((struct sockaddr *)&ss, len, out, (socklen_t)outlen, NULL, 0,
                        NI_NUMERICHOST) == 0)
            st = DDP_OK;
        else
            err = errno;
        close(fd);
    }
    freeaddrinfo(res);
    if (st != DDP_OK)
        return ddp_error(DDP_ERR_CONNECT, "no route from this host to '%s' (%s); check "
                         "the network configuration or pass the interface explicitly",
                         host, strerror(err));
    return DDP_OK;
}

ddp_status ddp_sock_ifname_addr(const char *ifname, char *out, size_t outlen) {
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) < 0)
        return ddp_error(DDP_ERR_SYS, "getifaddrs: %s", strerror(errno));
    const struct ifaddrs *v4 = NULL, *v6 = NULL;
    char names[512] = "";
    for (const struct ifaddrs *i = ifs; i != NULL; i = i->ifa_next) {
        if (i->ifa_addr == NULL) continue;
        int fam = i->ifa_addr->sa_family;
        if (fam != AF_INET && fam != AF_INET6) continue;
        if (strstr(names, i->ifa_name) == NULL && strlen(names) + strlen(i->ifa_name) + 3 <
            sizeof names) {
            if (names[0]) strcat(names, ", ");
            strcat(names, i->ifa_name);
        }
        if (strcmp(i->ifa_name, ifname) != 0) continue;
        if (fam == AF_INET && v4 == NULL) v4 = i;
        if (fam == AF_INET6 && v6 == NULL) v6 = i;
    }
    const struct ifaddrs *pick = v4 ? v4 : v6;
    ddp_status st = DDP_OK;
    if (pick == NULL) {
        st = ddp_error(DDP_ERR_INVALID, "network interface '%s' not found or has no IP "
                       "address (interfaces with addresses: %s)", ifname, names);
    } else {
        socklen_t len = pick->ifa_addr->sa_family == AF_INET
                            ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
        int g = getnameinfo(pick->ifa_addr, len, out, (socklen_t)outlen, NULL, 0,
                            NI_NUMERICHOST);
        if (g != 0)
            st = ddp_error(DDP_ERR_SYS, "interface '%s': cannot format its address (%s)",
                           ifname, gai_strerror(g));
    }
    freeifaddrs(ifs);
    return st;
}
