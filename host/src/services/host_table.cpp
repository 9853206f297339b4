#include "services/host_table.h"

#include "checkpoint/checkpoint.h"
#include "comm/comm_api.h"
#include "loader/host_api.h"
#include "mem/mem_api.h"
#include "model/model.h"
#include "optim/optim_api.h"

namespace cai {

const cai_host_api* HostServicesTable() {
  static const cai_host_api* table =
      MakeHostApi(HostServices{ModelApi(), OptimApi(), CommApi(), MemApi(), CheckpointApi()});
  return table;
}

}  // namespace cai
