/* cai ABI v1 — everything a plugin or host needs, in one include.
 *
 *   cai/core.h       versions, status, logging, tensor descriptor, config schema
 *   cai/model.h      model service
 *   cai/optimizer.h  optimizer service
 *   cai/comm.h       communicator service
 *   cai/mempool.h    memory pool service
 *   cai/plugin.h     host table, strategy table, checkpoint writer, entry point
 *
 * Pure C11; compiles as C and C++. The change history is in CHANGELOG.md beside these headers.
 */
#ifndef CAI_ABI_H_
#define CAI_ABI_H_

#include "cai/comm.h"
#include "cai/core.h"
#include "cai/mempool.h"
#include "cai/model.h"
#include "cai/optimizer.h"
#include "cai/plugin.h"

#endif /* CAI_ABI_H_ */
