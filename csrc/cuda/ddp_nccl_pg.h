/* ddp_nccl_pg.h - an NCCL communicator behind the one process-group
 * interface (ddp_pg.h). The returned ddp_pg borrows c: the caller keeps (or
 * takes, with ops->retain) a reference for as long as it uses it.
 */
#ifndef DDP_NCCL_PG_H
#define DDP_NCCL_PG_H

#include "ddp_nccl_comm.h"
#include "ddp_pg.h"

ddp_pg ddp_nccl_pg(ddp_nccl_comm *c);

#endif
