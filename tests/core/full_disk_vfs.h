#pragma once
// A full disk for SQLite, in tests: while a FullDisk exists it is SQLite's
// default VFS (every connection opened meanwhile uses it), the system's own
// VFS in every respect except that, while full(true) is set, each write
// returns SQLITE_FULL as a disk without space does (SQLite's unix VFS maps
// ENOSPC to the same code). Truncation, sync and the -shm file still work.
//
// Not thread-safe to construct; one at a time (doctest runs the test cases of
// a binary one after another). Close every connection opened through it
// before it goes: declare it before the store.
#include <sqlite3.h>

#include <atomic>

namespace sparrow::testing {

class FullDisk {
 public:
  FullDisk() : real_(sqlite3_vfs_find(nullptr)), vfs_(*real_) {
    vfs_.zName = "sparrow-test-full-disk";
    vfs_.szOsFile = static_cast<int>(sizeof(File)) + real_->szOsFile;
    vfs_.pAppData = this;
    vfs_.xOpen = &FullDisk::open;
    sqlite3_vfs_register(&vfs_, /*makeDflt=*/1);
  }
  ~FullDisk() {
    sqlite3_vfs_unregister(&vfs_);
    sqlite3_vfs_register(real_, /*makeDflt=*/1);
  }
  FullDisk(const FullDisk&) = delete;
  FullDisk& operator=(const FullDisk&) = delete;

  void full(bool on) { full_ = on; }
  int refused() const { return refused_; }  // writes refused so far

 private:
  // Our file: its methods, then the real VFS's file right behind it.
  struct File {
    sqlite3_file base;
    sqlite3_file* real;
    FullDisk* disk;
  };
  static sqlite3_file* real(sqlite3_file* f) { return reinterpret_cast<File*>(f)->real; }

  static int open(sqlite3_vfs* vfs, const char* name, sqlite3_file* f, int flags, int* out_flags) {
    auto* disk = static_cast<FullDisk*>(vfs->pAppData);
    auto* file = reinterpret_cast<File*>(f);
    file->real = reinterpret_cast<sqlite3_file*>(file + 1);
    file->disk = disk;
    const int rc = disk->real_->xOpen(disk->real_, name, file->real, flags, out_flags);
    file->base.pMethods = file->real->pMethods ? &kMethods : nullptr;
    return rc;
  }

  static int close(sqlite3_file* f) { return real(f)->pMethods->xClose(real(f)); }
  static int read(sqlite3_file* f, void* p, int n, sqlite3_int64 at) {
    return real(f)->pMethods->xRead(real(f), p, n, at);
  }
  static int write(sqlite3_file* f, const void* p, int n, sqlite3_int64 at) {
    FullDisk* disk = reinterpret_cast<File*>(f)->disk;
    if (disk->full_) {
      ++disk->refused_;
      return SQLITE_FULL;
    }
    return real(f)->pMethods->xWrite(real(f), p, n, at);
  }
  static int truncate(sqlite3_file* f, sqlite3_int64 n) { return real(f)->pMethods->xTruncate(real(f), n); }
  static int sync(sqlite3_file* f, int flags) { return real(f)->pMethods->xSync(real(f), flags); }
  static int file_size(sqlite3_file* f, sqlite3_int64* n) { return real(f)->pMethods->xFileSize(real(f), n); }
  static int lock(sqlite3_file* f, int l) { return real(f)->pMethods->xLock(real(f), l); }
  static int unlock(sqlite3_file* f, int l) { return real(f)->pMethods->xUnlock(real(f), l); }
  static int check_reserved(sqlite3_file* f, int* out) { return real(f)->pMethods->xCheckReservedLock(real(f), out); }
  static int file_control(sqlite3_file* f, int op, void* arg) {
    return real(f)->pMethods->xFileControl(real(f), op, arg);
  }
  static int sector_size(sqlite3_file* f) { return real(f)->pMethods->xSectorSize(real(f)); }
  static int device(sqlite3_file* f) { return real(f)->pMethods->xDeviceCharacteristics(real(f)); }
  static int shm_map(sqlite3_file* f, int region, int size, int extend, void volatile** p) {
    return real(f)->pMethods->xShmMap(real(f), region, size, extend, p);
  }
  static int shm_lock(sqlite3_file* f, int offset, int n, int flags) {
    return real(f)->pMethods->xShmLock(real(f), offset, n, flags);
  }
  static void shm_barrier(sqlite3_file* f) { real(f)->pMethods->xShmBarrier(real(f)); }
  static int shm_unmap(sqlite3_file* f, int del) { return real(f)->pMethods->xShmUnmap(real(f), del); }
  static int fetch(sqlite3_file* f, sqlite3_int64 at, int n, void** p) {
    return real(f)->pMethods->xFetch(real(f), at, n, p);
  }
  static int unfetch(sqlite3_file* f, sqlite3_int64 at, void* p) { return real(f)->pMethods->xUnfetch(real(f), at, p); }

  static constexpr sqlite3_io_methods kMethods = {
      3,         &close,       &read,           &write,        &truncate,    &sync,   &file_size,
      &lock,     &unlock,      &check_reserved, &file_control, &sector_size, &device, &shm_map,
      &shm_lock, &shm_barrier, &shm_unmap,      &fetch,        &unfetch};

  sqlite3_vfs* real_;
  sqlite3_vfs vfs_;
  std::atomic<bool> full_{false};
  std::atomic<int> refused_{0};
};

}  // namespace sparrow::testing
