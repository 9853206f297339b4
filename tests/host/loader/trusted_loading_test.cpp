// Code is loaded from the very file that was checked: the library is opened once, its owner,
// mode and sha256 are checked through that descriptor and the descriptor is what dlopen maps,
// so replacing the file at its path after the checks changes nothing that runs.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "core/status.h"
#include "loader/file_checks.h"
#include "loader/host_api.h"
#include "loader/registry.h"
#include "plugin_dir.h"
#include "util/subprocess.h"

namespace {

namespace fs = std::filesystem;

using cai::CheckedFile;
using cai::testing::Lib;
using cai::testing::ManifestText;
using cai::testing::PluginDir;

ino_t InodeOf(const fs::path& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_ino;
}

TEST(TrustedLoading, PathReplacedAfterTheChecks_LoadsTheFileThatWasChecked) {
  PluginDir dir;
  const fs::path path = dir.path() / "libplugin.so";
  dir.ReplaceWith(HELLO_SO, "libplugin.so");
  CheckedFile file = CheckedFile::Open(path);
  EXPECT_EQ(file.Sha256(), cai::Sha256File(HELLO_SO));
  struct stat checked {};
  ASSERT_EQ(::fstat(file.fd(), &checked), 0);
  const std::string loaded_as = "/proc/self/fd/" + std::to_string(file.fd());

  // Between the checks and the load, the path comes to name a library without the entry.
  dir.ReplaceWith(NO_ENTRY_SO, "libplugin.so");
  ASSERT_NE(InodeOf(path), checked.st_ino);

  void* handle = file.Load();
  ASSERT_NE(handle, nullptr);
  // The hashed inode is the one mapped, and it is hello_strategy's code that runs.
  EXPECT_EQ(InodeOf(loaded_as), checked.st_ino);
  EXPECT_NE(::dlsym(handle, "cai_plugin_init_v1"), nullptr);
}

TEST(TrustedLoading, LibraryReplacedAfterInspection_IsRefusedBySha256AtLoad) {
  PluginDir dir;
  const fs::path manifest =
      dir.Add(C_REPLICA_SO, "c_replica",
              ManifestText("c_replica", Lib(C_REPLICA_SO), "", "major = 1\nmin_host_minor = 0",
                           "sha256 = \"" + cai::Sha256File(C_REPLICA_SO) + "\"\n"));
  cai::PluginRecord record = cai::InspectManifest(manifest, "test");
  ASSERT_EQ(record.error, "");

  dir.ReplaceWith(HELLO_SO, Lib(C_REPLICA_SO));
  try {
    // A host table lives for the process (plugins keep the pointer), as the host's does.
    static const cai_host_api* const host = cai::MakeHostApi({});
    cai::LoadPlugin(record.manifest, host);
    ADD_FAILURE() << "loaded a library whose sha256 no longer matches its manifest";
  } catch (const cai::Error& e) {
    EXPECT_EQ(e.code(), CAI_DATA_LOSS);
    CAI_EXPECT_CONTAINS(std::string(e.what()), (dir.path() / Lib(C_REPLICA_SO)).string() +
                                                   ": sha256 mismatch: manifest " +
                                                   manifest.string());
  }
}

TEST(TrustedLoading, LinkToAFileInAnOpenDirectory_IsRefusedNamingThatDirectory) {
  PluginDir trusted, open_dir;
  open_dir.ReplaceWith(HELLO_SO, "libplugin.so");
  chmod(open_dir.path().c_str(), 0777);
  const fs::path link = trusted.path() / "libplugin.so";
  fs::create_symlink(open_dir.path() / "libplugin.so", link);
  try {
    CheckedFile::Open(link);
    ADD_FAILURE() << "accepted a library in a directory anyone can write";
  } catch (const cai::Error& e) {
    EXPECT_EQ(e.code(), CAI_PERMISSION_DENIED);
    CAI_EXPECT_CONTAINS(std::string(e.what()),
                        open_dir.str() +
                            ": refused: directory is writable by group or others "
                            "(mode 0777), so anyone could replace the plugin code; "
                            "run 'chmod go-w " +
                            open_dir.str() + "'");
  }
}

}  // namespace
